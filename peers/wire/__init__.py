"""The bytes: how a pseudo-gradient is laid out whatever the island's shape (:mod:`.layout`), how its pieces
move inside an island (:mod:`.exchange`), how a round's parts travel between islands (:mod:`.transport`,
plain TCP, put together from the port a server's ranks share and its bound on strangers (:mod:`.listener`), one
connection's handshake and sealed frames (:mod:`.secure`), the connections a rank sends on (:mod:`.links`), the
ways to reach a rank behind NAT (:mod:`.nat`: lanes, relay, hole punching) and the key a rank proves its peer id
with (:mod:`.identity`); :mod:`.encoded`, codecs' payloads over the transport or hivemind's daemon, with
:mod:`.deflate` on the wire), θ_global for joiners (:mod:`.state_share`), messages that arrive early
(:mod:`.inbox`), the names a round goes by (:mod:`.round_keys`), the host's loop on hivemind's daemon
(:mod:`.p2p_loop`), the kernel's byte counts (:mod:`.counters`), the link between two servers, measured
before a run (:mod:`.probe`, ``diloco probe``), and during it, from the rounds' exchanges (:mod:`.link_fit`,
what ``--averaging.compression auto`` picks its codec by), and whether other servers can connect to this one
(:mod:`.dial_back`, asked of a reachable island when joining).

Everything about reaching another island's ranks (ports, NAT, encryption, who is at the other end) belongs here.

May import: :mod:`peers.settings`, :mod:`peers.result`, :mod:`peers.fingerprints`, :mod:`peers.discovery` (the member check of a
private run), :mod:`outer_optim`, hivemind.
"""
