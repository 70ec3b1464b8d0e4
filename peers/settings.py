"""The settings of an island rank's peer node and averager: where it listens, what it announces, whom it joins,
how its rounds form and time out, and how its pseudo-gradients travel.

Plain data without hivemind, so that the trainer's config section ``averaging`` can *be* these settings
(:class:`diloco.config.AveragingConfig` *is* :class:`PeerSettings`) rather than copy them.
"""

from __future__ import annotations

import re
from dataclasses import Field, dataclass, field

from outer_optim.compression import AUTO_CODECS, TOPK_DEFAULT_BITS, TOPK_DEFAULT_DENSITY, may_drop


SECRET = {"secret": True}
"""The metadata of a setting that must never leave the process (:func:`is_secret`): it is left out of every
config the trainer writes or logs, and of the settings' ``repr``."""


def is_secret(setting: Field) -> bool:
    """Whether a dataclass field of the settings is a secret (declared with ``metadata=SECRET``)."""
    return bool(setting.metadata.get("secret"))


@dataclass
class NetworkSettings:
    """Where an island listens, what it announces and whom it joins."""

    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of running islands or bootstrap nodes (ending in /p2p/PEER_ID); empty starts a new run."""
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    """Multiaddrs this island's DHT listens on; use /ip4/0.0.0.0/tcp/PORT to accept peers from other servers (its
    transport takes the next port, `transport_port`)."""
    announce_maddrs: list[str] = field(default_factory=list)
    """Multiaddrs to advertise to peers (your public IP and forwarded port), if not the listening ones."""
    identity_path: str = ""
    """File holding this island's private key, so its peer id stays the same across restarts."""
    client_mode: bool = False
    """Accept no incoming connections (an island behind a NAT or a firewall): it opens every connection
    itself, and other islands send it their bytes back over them; it takes full part in the rounds."""
    hole_punch: bool = True
    """Behind NAT: open connections to the other islands behind NAT through both NATs at once (TCP hole
    punching, which takes a NAT that keeps a connection's port whatever its destination, as most do), so that
    every island owns its share of a round's averaging. Where a punch fails, that island's bytes are relayed by
    a reachable island. False: the reachable islands average for the islands behind NAT (a star), which is
    faster than relaying: set it on the islands behind a NAT that gives each destination its own port."""
    dial_back: bool = True
    """On joining a run, ask a reachable island to connect back to the address this island would announce and
    to its DHT's port; if none can, take part as with ``client_mode`` true (and say so) instead of announcing
    an address nobody reaches. False: trust ``client_mode`` as given."""
    startup_timeout: float = 20.0
    """Seconds to connect to initial peers before giving up with an error."""
    transport_port: int = 0
    """TCP port this island takes a round's bytes and requests for state on, for all its ranks (rank 0 hands
    each connection to the rank it is for); 0: the port after the DHT's (`host_maddrs`), or a free one when the
    DHT's is 0. A server other islands reach opens the DHT's port and this one: with the default, one range,
    e.g. 31337-31338. Islands sharing a server (one torchrun world) each take 2 ports more than the one before."""
    encrypt: bool = True
    """Seal every byte islands send each other over the direct transport (AES-256-GCM, fresh keys per
    connection); false sends them in the clear after the authenticated handshake, each record still tagged
    (GMAC), so that bytes changed on the way are refused: only privacy is given up. Every island of a run
    must agree."""
    run_key: str = field(default="", repr=False, metadata=SECRET)
    """Shared secret of the run, given as is: only islands holding it can join, average or download state. On
    the command line `ps` and the shell history show it (the island warns): prefer `run_key_file` or the
    DILOCO_RUN_KEY environment variable. Never written anywhere (config files, checkpoints, W&B, logs); a key
    estimated below 128 bits of entropy is stretched with scrypt, salted with the run id."""
    run_key_file: str = ""
    """File holding the run key (one line, mode 600; empty: `<run dir>/run.key`). The first island of a
    private run writes a fresh key there when there is none, and its join line names the file: the other
    islands of the run get a copy of it (or its content in DILOCO_RUN_KEY). A key given in DILOCO_RUN_KEY or
    as `run_key` is kept in `<run dir>/run.key`, stretched if weak, for an island restarted with --resume."""


@dataclass(frozen=True)
class Scope:
    """Where an averager's rounds happen and who may take part: what the island is, not how it averages
    (that is :class:`peers.settings.AveragerSettings`)."""

    prefix: str = "diloco"
    """DHT prefix shared by all islands of a run (the run id)."""
    private: bool = False
    """Serve only islands registered in the run's member registry (see peers.discovery.membership)."""
    members_key: str = ""
    """DHT key of that member registry (empty: ``f"{prefix}.members"``)."""
    client_mode: bool = False
    """No incoming connections: this island neither forms groups for others nor takes their requests."""
    direct_votes: bool = True
    """Send verdicts straight to the group members (False: only through the DHT, polled: the vote as it
    was before, kept for benchmarks/round_cost.py and tests)."""

    @property
    def registry(self) -> str:
        """The DHT key of the run's member registry."""
        return self.members_key or f"{self.prefix}.members"


@dataclass
class AveragerSettings:
    """How islands form a round's group, how long each step may take and how pseudo-gradients travel."""

    min_group_size: int = 2
    """A round with fewer islands than this is rejected and the island keeps its own parameters."""
    wait_for_islands: int = 0
    """The islands a new run expects: before training, wait (up to matchmaking_timeout) until this many have
    registered (0: don't), and let no round commit before a majority of them averaged it. Without it, the first
    round counts the islands registered when it starts: set it when a run's islands start at once, so that a DHT
    split at the very start (two halves that have not met yet) cannot start two runs."""
    max_group_size: int = 16
    """The most islands that average in one flat group: a round of more is split, the same way on every island, into
    groups of near-equal size that average inside themselves and then across (each part of a bucket among one member
    of each group), so that an island talks to about max_group_size + islands/max_group_size others, not to every
    island (0: one flat group whatever the size)."""
    target_group_size: int = 0
    """A round's leader closes its roster as soon as this many islands joined (0: when every island the registry
    expects at the round joined, or a majority of the run did and `matchmaking_time` passed)."""
    matchmaking_time: float = 5.0
    """Seconds a round's leader that holds a majority of the run waits for the islands still expected (late or
    dead ones do not hold a run up longer than this)."""
    matchmaking_timeout: float = 60.0
    """Give up forming a round's group after this many seconds (must exceed matchmaking_time)."""
    request_timeout: float = 3.0
    """Seconds a join may take to reach a round's leader before the next island of the order is tried (must be
    below matchmaking_time)."""
    allreduce_timeout: float = 120.0
    """Seconds to wait for the other members' parts of Δ in each stage of a round's exchange (reduce-scatter,
    then all-gather); a part not there by then fails the round (retried among the members left)."""
    next_chunk_timeout: float = 30.0
    """Give up on a peer that sends nothing for this many seconds in hivemind's all-reduce of the group's
    metadata while the group forms (Δ's parts wait up to `allreduce_timeout`)."""
    vote_timeout: float = 15.0
    """Seconds to wait for every group member to confirm the averaged result."""
    state_download_timeout: float = 60.0
    """Seconds a joining island spends downloading the global state from a peer."""
    compression: str = "none"
    """Wire format of pseudo-gradients: `none` (fp32), `fp16` (half precision), `int8` (blocks of 256 with an absmax scale), `int4` (blocks of 128, absmax scale), `int2` (blocks of 256: a sign and one of two magnitudes fitted to the block, 2 bits a value), `sign` (1 bit per value: its sign times a bfloat16 scale per block of 256, the block's mean magnitude) and `topk` (per chunk of 4096 the `topk_density` largest entries, `topk_bits` bits each, 12-bit indices), with error feedback for the lossy ones (dense codecs reduce-scatter from 3 islands on, `topk` all-gathers); or `auto`: each round the group picks the most faithful of `auto_codecs` whose bytes the link, as measured in earlier rounds, moves in the time overlap hides plus `diloco.max_comm_fraction` of the round (the fewest bytes until every member has measured its link); the error feedback carries across changes of codec."""
    auto_codecs: list[str] = field(default_factory=lambda: list(AUTO_CODECS))
    """With `compression auto`: the codecs it may pick, the most faithful first."""
    topk_density: float = TOPK_DEFAULT_DENSITY
    """Fraction of each chunk of 4096 values the `topk` codec sends, in (0, 1]."""
    topk_bits: int = TOPK_DEFAULT_BITS
    """Bits per value sent by the `topk` codec: 2 or 4."""
    error_feedback: bool = True
    """With `fp16`, `int8`, `int4`, `int2`, `sign`, `topk` or `auto`: carry what the codec dropped into the next round (per island, checkpointed, reset when the island adopts another island's state); see `owner_feedback` for what re-encoding an averaged part drops."""
    error_feedback_decay: float = 1.0
    """β of the error feedback e ← β·e + Δ, in (0, 1] (SparseLoCo uses 0.95)."""
    error_feedback_in: str = "params"
    """Where the part of Δ a codec dropped waits for later rounds: `params` (the island trains on from θ_global − β·e instead of θ_global, so its next Δ carries that part) or `buffer` (added to the next Δ before it is encoded, as EF21 and SparseLoCo do; the island restarts from θ_global, which lacks that part, and learns much of it again, so it is sent twice)."""
    owner_feedback: bool = False
    """With error feedback on `int8`, `int4` or `sign` among 3 islands or more (a reduce-scatter): the owner of each averaged part carries what re-encoding that average dropped into the part's next average (checkpointed, reset with the error feedback). Off by default, as in hivemind's own butterfly: over 12 rounds it left `int4` unchanged and made `sign` worse (+6.0% against +4.4% without)."""
    entropy_coding: bool = True
    """With `int8` or `int4`: Huffman-code each payload on the wire, losslessly (a payload that would not shrink goes as it is). It takes back what the codes' skewed distribution leaves: measured on a real Δ, `int4` payloads shrink to 0.846 of the codec's size, `int8` to 0.926 (`sign` and `topk` would hardly shrink, 0.99, and are never coded). It costs about 8 ms of one core per MB of payload to code, less to decode: with blocking rounds on links faster than about 150 Mbit/s per island, coding takes longer than the bytes it saves; turn it off there."""
    aggregate: str = "mean"
    """How a group's pseudo-gradients become one: `mean` (weighted by `weighting`), or a rule robust to a member
    that lies: `clipped` (each Δ cut to twice the median norm), `centered-clip` (BTARD's CenteredClip) or
    `trimmed-mean` (per value, the extremes dropped). With a robust rule every member computes the whole aggregate
    itself from every member's payload, so that no member's share of the work is taken on trust: (n − 1)·c bytes
    each way instead of 2(n − 1)/n·c (a low-bit codec pays for it). Every island of a run must use the same rule."""
    weighting: str = "auto"
    """What a member's Δ weighs in the `mean`: `equal` (every member alike: a declared weight is a claim nobody can
    check), `tokens` (the tokens it declares it trained on, capped at 8× the group's median claim) or `auto`
    (`equal` when rounds fall due by inner steps, where honest islands train the same tokens; `tokens` under a
    `--diloco.sync_every` budget of time or tokens, whose islands of unequal speed train unequal tokens). Either way
    the group's token count that scales a Δ sent per million tokens back is the capped one."""
    member_check: float = 10.0
    """A member's Δ counts for nothing in a round (and, with a robust `aggregate`, earns a strike) when it is not
    finite or its norm is above this many times the group's median member norm (0: only the finiteness check).
    Under `mean`, each part's owner checks the part it averages."""
    outlier_ratio: float = 3.0
    """With a robust `aggregate`: a member's Δ that lies farther from the aggregate than this many times the group's
    median member norm and points away from it (a negative dot product: it pulls θ_global back) counts for nothing
    (3 members or more; the aggregate is taken again without it) and earns a strike. 0: never. An honest island on
    data unlike the others' drifts out over a run (2.9 norms after 30 rounds of `tiny`) but keeps pulling the
    aggregate's way."""
    strikes: int = 2
    """With a robust `aggregate`: after this many rounds whose committed result rejected its Δ (or found it an
    outlier: `outlier_ratio`), a member is left out of the run's rounds (the log and the metrics name it). 0:
    never."""
    transport: str = "direct"
    """How a round's bytes travel between islands: `direct` (TCP between the ranks, sealed with AES-GCM unless --averaging.encrypt false: as fast as a gloo all-reduce; the run key authenticates every connection) or `p2p` (hivemind's daemon: encrypted, several times slower)."""


@dataclass
class PeerSettings(NetworkSettings, AveragerSettings):
    """Everything an island rank's peer node is told: where it listens and whom it joins
    (:class:`NetworkSettings`), how its rounds form and travel (:class:`AveragerSettings`), and the run it belongs
    to (below)."""

    backend: str = "hivemind"
    """`hivemind` (peer-to-peer over the internet), `local` (no peers: a group of one), `torch` (islands
    launched as one torchrun world average with a torch.distributed all-reduce) or `auto` (hivemind, falling
    back to that all-reduce when no hivemind group forms); `torch` and `auto` average shard-wise."""
    run_id: str = "diloco"
    """Name shared by all islands of one run: the DHT prefix of its averager."""
    maddr_file: str = ""
    """If set, write this island's visible multiaddrs to this file once it is reachable."""
    public: bool = False
    """Run without a run key: anyone who reaches an island may join (not recommended over the internet)."""
    retry_lost_member: bool = True
    """When a group member is lost mid-round (its verdict never comes, or two members received different
    results), the members left average the same pseudo-gradients once more among themselves instead of
    rolling the round back; and when no group formed although the registry lists a live island still
    training towards this round (restarted or caught up), the island waits for it once more."""
    max_norm_ratio: float = 10.0
    """Reject a round whose averaged pseudo-gradient norm exceeds this multiple of the median of recent
    committed rounds (0 disables the check); per million tokens under a `sync_every` budget other than steps, whose rounds differ in length."""
    member_ttl: float = 60.0
    """Seconds an island's registration lives without a heartbeat (refreshed every third of it, at least every 3 s: an island that missed a beat does not hold up a catch-up)."""
    rejoin_after: float = 30.0
    """Seconds an island alone in the run, although it knew live islands (it restarted while none of them
    answered, or the network split), waits before it restarts its peer node through their addresses;
    the wait doubles after each try, up to ten times this.  Also how often an island apart from islands of its
    committed roster (their records stopped refreshing: a partition, or its DHT half after one healed) looks
    whether their addresses answer, and restarts its peer node through them once they do."""
    bucket_numel: int = 4_000_000
    """Elements per bucket of the pseudo-gradient (the unit one island rank averages with the other islands,
    each bucket over its own hivemind averager); must be the same on every island of a run."""


def codec_backend_problem(compression: str, backend: str) -> str:
    """Why pseudo-gradients of codec ``compression`` cannot be averaged by ``backend`` ('' when they can): the
    torch all-reduce carries fp32 only, the lossy codecs travel over hivemind's groups."""
    if may_drop(compression) and backend not in ("hivemind", "auto"):
        return (f"--averaging.compression {compression} travels over hivemind: use --averaging.backend hivemind "
                f"or auto (got {backend})")
    return ""


PORTS_PER_RANK = 2
"""TCP ports a server's local rank ``r`` takes from a configured port P: its DHT's, P + 2r, and its transport's, the
next one, so that islands sharing a server (one torchrun world, each shifted by its first rank's local rank) never
reach into each other's ports, and a server with one island opens one range of two ports, P and P + 1."""
_TCP_PORT = re.compile(r"^/(?:ip4|ip6|dns|dns4|dns6)/[^/]+/tcp/(\d+)")


def dht_port(a: NetworkSettings) -> int:
    """The TCP port the DHT of local rank 0 is configured to listen on: the first of ``host_maddrs`` (0 if none,
    or any free port)."""
    return next((int(m[1]) for m in map(_TCP_PORT.match, a.host_maddrs) if m), 0)


def transport_port(a: NetworkSettings, local_rank: int = 0) -> int:
    """The TCP port the transport of the island whose first rank has ``local_rank`` on its server listens on:
    ``transport_port`` when set, else the port after its DHT's (:data:`PORTS_PER_RANK`), so that a server behind
    a firewall opens one range of two ports; 0, a free port, when the DHT's is 0 too (tests, one machine).

    It cannot be the DHT's own port: hivemind's libp2p daemon owns that listener.  The daemon lets a second
    listener bind the port (SO_REUSEPORT), but the kernel then deals each new connection to one of the two at
    random, when its first packet arrives and before any byte says which it is for, and the daemon cannot be
    handed a connection accepted elsewhere (see "Ports" in docs/averaging.md)."""
    if a.transport_port:
        return a.transport_port + PORTS_PER_RANK * local_rank
    port = dht_port(a)
    return port + PORTS_PER_RANK * local_rank + 1 if port else 0


def port_problems(a: NetworkSettings) -> list[str]:
    """One sentence per port setting that cannot work (the transport's port out of range or on the DHT's)."""
    if not 0 <= a.transport_port <= 65535:
        return [f"--averaging.transport_port must be a TCP port (1-65535, or 0 for the port after the DHT's), got "
                f"{a.transport_port}"]
    taken = {int(m[1]) for m in map(_TCP_PORT.match, a.host_maddrs) if m}
    if a.transport_port and a.transport_port in taken:
        return [f"--averaging.transport_port {a.transport_port} is the DHT's port (--averaging.host_maddrs): the "
                f"transport needs a port of its own; leave it 0 for the next one, {a.transport_port + 1}"]
    if not a.transport_port and dht_port(a) == 65535:
        return ["--averaging.host_maddrs takes port 65535, which leaves no next port for the transport: pick a "
                "lower port or set --averaging.transport_port"]
    return []
