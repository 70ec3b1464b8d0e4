"""The bytes between islands: how a round's parts travel (:mod:`.transport`, plain TCP, put together from the port a
server's ranks share and its bound on strangers (:mod:`.listener`), one connection's handshake and sealed frames
(:mod:`.secure`), the connections a rank sends on (:mod:`.links`), the ways to reach a rank behind NAT
(:mod:`.nat`: lanes, relay, hole punching), proven with the key a rank's peer id names (:mod:`peers.identity`);
:mod:`.encoded`, codecs' payloads over the transport or hivemind's daemon, entropy-coded on the wire by
:mod:`outer_optim.compression.entropy`), θ_global for joiners (:mod:`.state_share`), messages that arrive early
(:mod:`.inbox`), the names a round goes by (:mod:`.round_keys`), the host's loop on hivemind's daemon
(:mod:`.p2p_loop`), the kernel's byte counts (:mod:`.counters`), the link between two servers, measured
before a run (:mod:`.probe`, ``diloco probe``), and during it, from the rounds' exchanges (:mod:`.link_fit`,
what ``--averaging.compression auto`` picks its codec by), and whether other servers can connect to this one
(:mod:`.dial_back`, asked of a reachable island when joining).

Everything about reaching another island's ranks (ports, NAT, encryption, who is at the other end) belongs here.

May import: :mod:`peers.settings`, :mod:`peers.result`, :mod:`peers.fingerprints`, :mod:`peers.discovery` (the member check of a
private run), :mod:`peers.island` (a joiner's download lands in the island's buckets), :mod:`outer_optim`, hivemind.
"""
