"""Who belongs to a run: registrations, heartbeats and clean leaves (the run key that signs a private
run's records is :mod:`peers.discovery.run_key`).

Members register their peer id under ``<prefix>.members``; the averager consults that
registry before letting a peer join a group, send parts or download state.

An island of several processes (tensor/pipeline parallel) registers every rank's peer id, each
record naming its island (the peer id of the island's rank 0) and rank; the island-level queries
(:meth:`Membership.others`, :meth:`~Membership.live_count`, :meth:`~Membership.furthest`) count
distinct islands, not processes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from collections.abc import Mapping
from typing import Any, Callable

import hivemind
from hivemind.utils import get_dht_time

from peers.discovery.calls import DHTUnavailableError, dht_get
from peers.discovery.owned import owned_items, store_owned
from peers.fingerprints import digest, fingerprints_agree, majority_by_state

Position = tuple[int, int]
"""How far along the run an island is: (rounds its θ_global's lineage committed, its outer step), compared in that
order.  Rounds that roll back advance the outer step alone, so an island cut off from the run's majority may number
its rounds further than the majority while its θ_global is older: the rounds committed decide first."""

LANE_PREFIX = "lane:"
"""What a rank that cannot be reached puts before its ``HOST:PORT`` (see :mod:`peers.wire.transport`)."""


PUNCH_PREFIX = "punch:"
"""What a rank that cannot be reached but takes part in hole punching puts before its ``HOST:PORT`` instead: a
connection to it opens when both ends dial each other at once (see :mod:`peers.wire.transport`)."""


def behind_nat(endpoint: str) -> bool:
    """Whether the rank that announced ``endpoint`` takes no connection it did not ask for (a lane, punched or
    not)."""
    return endpoint.startswith((LANE_PREFIX, PUNCH_PREFIX))


def punchable(endpoint: str) -> bool:
    """Whether the rank that announced ``endpoint`` sits behind NAT and takes part in hole punching."""
    return endpoint.startswith(PUNCH_PREFIX)


def address_of(endpoint: str) -> str:
    """``HOST:PORT[/SLOT]`` of an endpoint, without what says it sits behind NAT."""
    return endpoint.removeprefix(LANE_PREFIX).removeprefix(PUNCH_PREFIX)


def takes_connections(endpoint: str) -> bool:
    """Whether the rank that announced ``endpoint`` accepts incoming connections (it is not behind NAT)."""
    return bool(endpoint) and not behind_nat(endpoint)


log = logging.getLogger(__name__)

FINAL_RECORD_TTL = 3600.0
"""Seconds the record of an island that finished the run lives on after it left: while a DHT node of the run
(a bootstrap node) keeps it, an island that arrives late learns that the run ended instead of waiting alone."""
HEARTBEAT = 3.0
"""Shortest time between two refreshes of an island's registration (a third of the ttl when shorter): how soon an
island that died without leaving can be told from one that is alive, in a small run (see :data:`BEAT_PACE`)."""
FRESH = 1.0
"""Shortest time one read of the registry answers every question asked of it (see :data:`READ_PACE`).  The island's
threads (the round's, the background look-up, the end check) each asked on their own, some ten times a second, and
16 islands sent 25 MB each a round, against a payload of 55 kB.  Records change at most once a heartbeat or a
round."""
READ_PACE = 8.0
"""Records a second an island's questions read from the registry, at most: a read answers for the registry's
records ÷ this seconds when that is longer than :data:`FRESH`.  hivemind answers a look-up passing a node that holds
a key with the key's whole value, so that one read of the registry costs every record once per DHT node it visits
(251 kB for one read at 32 islands): read once a second, each island sent 515 kB/s at 32 islands while
it waited for a group, 17 times what it sent at 4 (``python -m benchmarks.registry_bytes``).  Paced, what an island
sends to keep the registry stays level however many islands there are, and an island learns of a change within
records ÷ 8 seconds (4 s at 32 islands, 8 s at 64)."""
BEAT_PACE = 4.0
"""Records a second an island's heartbeats cost it, at most, as :data:`READ_PACE` for reads: hivemind's store looks
for the nodes to store at first, and that look-up answers with the whole registry too (224 kB at 32 islands).  The
heartbeat period is the registry's records ÷ this seconds when that is longer than :data:`HEARTBEAT` (and at most a
third of the ttl); an island publishes its period, so that others judge its beats by it."""
READ_BEAM = 8
"""The DHT nodes nearest the registry's key that a read of it keeps searching (hivemind's default, 20, visits every
node of a run of up to 20 islands, each answering with every record): the 5 that every record is stored at
(hivemind's ``num_replicas``), and 3 more for one that died or a routing table a look behind."""

@dataclass
class Member:
    """A registered island (or one rank of it) as seen in the DHT."""

    peer_id: str
    outer_step: int
    left: bool
    averaging: bool = False
    """True while the island is in the averaging phase of round ``outer_step``."""
    island: str = ""
    """The island this peer belongs to (its rank 0's peer id); empty is read as ``peer_id``."""
    rank: int = 0
    """The peer's rank inside its island."""
    maddrs: tuple[str, ...] = ()
    """Where this peer can be reached (its visible multiaddrs), so islands can find it again after a restart."""
    final: Any = None
    """After its last round: ``{"outer_step": N, "state": fingerprint}`` of the θ_global it ends with."""
    expires: float = 0.0
    """DHT time at which its record expires (its last refresh plus its ttl)."""
    endpoint: str = ""
    """Where this peer's transport takes a round's bytes and requests for state (``host:port``)."""
    serving: bool = True
    """Whether the island serves its θ_global now (not while it replaces it with another island's)."""
    committed: int = 0
    """Rounds the lineage of its θ_global committed (its outer optimizer's steps): with ``outer_step``, its
    :attr:`position` in the run."""
    held: Any = None
    """The :func:`peers.fingerprints.digest` of the θ_global it holds at its position (announced while it averages a
    round: the one it entered it with): what a state downloaded from an island at that position must match, and
    what an island entering the same round compares its own with (:meth:`Membership.outvoted`)."""
    read_at: float = 0.0
    """DHT time at which the read that brought this record started (0: not read): how fresh a record is counts from
    there, not from the moment it is looked at (a read takes seconds on a loaded machine, and answers for
    :attr:`Membership.fresh` more)."""
    beat: float = 0.0
    """Seconds between the island's heartbeats, as it published them (0: the shortest, :data:`HEARTBEAT`)."""

    @property
    def position(self) -> Position:
        """How far along the run the island is (see :data:`Position`)."""
        return self.committed, self.outer_step

    def reachable(self) -> bool:
        """Whether this live peer takes incoming connections: its transport endpoint is not a lane (see
        :mod:`peers.wire.transport`)."""
        return not self.left and takes_connections(self.endpoint)


@dataclass
class Snapshot:
    """One read of the registry, as an island enters round ``outer_step`` (see :meth:`Membership.snapshot`)."""

    endpoints: dict[str, str]
    """Island id → its rank 0's transport endpoint, for the live islands (this one included)."""
    coming: set[str]
    """Live islands that will come to this round: training towards it or averaging it, or still finishing the round
    before (this one included)."""
    absent: set[str]
    """Islands known not to take part in this round: they left the run before it (a record that left at this
    outer step or earlier), or nothing listens at their address any more and their record is not past it."""
    seen: int
    """Live islands (this one included)."""


def _seconds(value: Any) -> float:
    """A record's positive, finite number of seconds; 0.0 for anything else."""
    return float(value) if isinstance(value, (int, float)) and 0 < value < math.inf else 0.0


def _count(value: Any) -> int:
    """A count from a peer's record (anything else: 0; a peer's record is untrusted)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def confirmed_position(others: list[Position]) -> Position:
    """The furthest position that at least half of the run's live islands reached, given the positions ``others``
    of the other live islands (this island counted among those not there; (-1, -1) if none is live).  One island
    alone cannot move it: a member that announces a position it does not hold (the registry takes any record from
    a holder of the run key) draws no catch-up, while a position the run really reached always has a majority
    behind it (a round commits only for one)."""
    need = (len(others) + 2) // 2  # the fewest islands that are at least half of len(others) + 1
    ranked = sorted(others, reverse=True)
    return ranked[need - 1] if others else (-1, -1)


def run_moved_past(others: list[Position], mine: Position) -> bool:
    """Whether an island at position ``mine`` is behind the run, given the positions ``others`` of the other live
    islands: at least half of the run's live islands (this one counted) are ahead of it (:func:`confirmed_position`),
    so the islands left can no longer hold a majority of the run in its round, and the run's θ_global is ahead of
    this island's (more rounds committed) or its round numbering is (as many committed, more rolled back).  After a
    partition heals, the side that could not commit learns so within a look, instead of waiting out the matchmaking
    timeout, and catches up rather than forming a group of its own, even when its rounds that failed numbered
    further; of two sides that both committed nothing, the one whose numbering is behind takes the other's."""
    return confirmed_position(others) > mine


def run_numbers_behind(others: list[Position], mine: Position) -> bool:
    """Whether the run is still at an earlier round of this island's lineage, given the positions ``others`` of the
    other live islands: the position at least half of the run reached (:func:`confirmed_position`) committed as many
    rounds as this island but numbers its round before this island's.  Rounds this island failed alone (quickly: a
    group it could not join, a leader it never agreed on) moved its numbering past a run still averaging a slower
    round; averaging on would be averaging alone, round after round, ahead of the run (of 48 islands, one failed 6
    rounds in a row so while the run took 2 minutes a round, ran out of rounds and ended apart from the run).  Such an
    island waits for the run's round to end instead: committed, the run is further along and the island catches up;
    failed, the run numbers its next round as the island does, and they meet."""
    run = confirmed_position(others)
    return run[0] == mine[0] and run[1] < mine[1]


def meeting_step(lineage: list[int], mine: int) -> int:
    """The round an island at outer step ``mine`` averages next, given the outer steps ``lineage`` of the other live
    islands whose θ_global's lineage committed as many rounds as its own: ``mine``, or a later step that enough of
    them number their rounds at or beyond to meet there.

    Rounds that fail move an island's outer step on, and islands starved at different moments fail different rounds:
    islands of one θ_global end up numbering their rounds apart, each round's group holds only those at its number,
    no group holds a majority, and every round fails on, the spread kept (a 16-island run committed 2 rounds of 10 so).
    Their θ_global being one, a round's number is only where they meet: an island numbering behind joins the islands
    ahead at theirs (its Δ is the same), and the spread closes within a round.  The step is the highest that at least
    a quarter of the lineage (two islands, with three or more) reach or pass, so that one member announcing a step far
    ahead draws nobody past the run's rounds; islands never move back, so round ids stay unique per attempt."""
    ahead = sorted((s for s in lineage if s > mine), reverse=True)
    size = len(lineage) + 1
    need = max(min(2, size - 1), -(-size // 4))
    return ahead[need - 1] if need and len(ahead) >= need else mine


class Membership:
    """Registers this island (or one rank of it), keeps the registration alive, and lists the run's
    live islands.  ``island`` is the island's id (its rank 0's peer id; empty: this peer's id) and
    ``rank`` this process's rank in it."""

    def __init__(self, dht: hivemind.DHT, prefix: str, ttl: float = 60.0, *, island: str = "", rank: int = 0):
        self.dht = dht
        self.key = f"{prefix}.members"
        self.peer_id = str(dht.peer_id)
        self.island = island or self.peer_id
        self.rank = int(rank)
        self.ttl = ttl
        self._shortest_period = min(ttl / 3, HEARTBEAT)
        self.registry_size = 1
        """Records the last read of the registry found: what reads and heartbeats are paced by (:attr:`period`,
        :attr:`fresh`)."""
        self.outer_step = 0
        self.averaging = False
        self.maddrs: list[str] = []
        """This peer's visible multiaddrs, published with every registration."""
        self.endpoint = ""
        """This peer's transport endpoint, published with every registration."""
        self.serving = True
        """Whether this island serves its θ_global to joiners now (published)."""
        self.held: Any = None
        self.final: dict | None = None
        """Set when the island has finished training (kept in its record, also after it leaves)."""
        self.refuses: Callable[[str], bool] | None = None
        """Whether nothing listens at a transport endpoint any more (:func:`peers.wire.transport.refuses`):
        asked of the other islands' rank 0 endpoints while this island looks for a group (see :meth:`company`)."""
        self._gone: dict[str, float] = {}  # island id -> its record's expiry when its address refused us
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.committed_rounds: Callable[[], int] = lambda: 0
        """Rounds the lineage of this island's θ_global committed (its outer optimizer's steps), announced with the
        outer step: the island's :data:`Position`.  The island sets it once it holds an outer optimizer."""
        self._steps: list[Position] | None = None  # the other live islands' positions, read in the background
        self._steps_wanted = 0.0
        self._steps_lock = threading.Lock()
        self._steps_thread: threading.Thread | None = None
        self._read: tuple[float, dict[str, Member]] | None = None  # (time.monotonic() of the last read, its records)
        self._seen: dict[str, Member] = {}
        """Every record the reads so far brought, as the last one that held it read it (see :meth:`members`)."""
        self._announced = 0  # announces so far: a read started before the last one is not kept
        self._read_lock = threading.Lock()
        self._store_lock = threading.Lock()

    @property
    def period(self) -> float:
        """Seconds between two refreshes of this island's registration: :data:`HEARTBEAT` (or a third of the ttl),
        longer in a run of more than 12 islands (see :data:`BEAT_PACE`)."""
        return min(self.ttl / 3, max(self._shortest_period, self.registry_size / BEAT_PACE))

    @property
    def fresh(self) -> float:
        """Seconds a read of the registry answers every question asked of it: :data:`FRESH`, longer in a run of more
        than 8 islands (see :data:`READ_PACE`)."""
        return max(FRESH, self.registry_size / READ_PACE)

    def forget_read(self) -> None:
        """Make the next question read the registry again."""
        with self._read_lock:  # a read started before this is not kept either
            self._read, self._announced = None, self._announced + 1

    def _value(self, **extra: object) -> dict:
        value: dict = {"outer_step": self.outer_step, "committed": self.committed_rounds(), "averaging": self.averaging,
                       "left": False}
        if self.island != self.peer_id or self.rank:
            value.update(island=self.island, rank=self.rank)
        if self.maddrs:
            value["maddrs"] = list(self.maddrs)
        if self.endpoint:
            value["endpoint"] = self.endpoint
        if not self.serving:
            value["serving"] = False
        if self.held is not None:
            value["held"] = list(self.held)
        if self.final is not None:
            value["final"] = self.final
        if self.period > self._shortest_period:
            value["beat"] = round(self.period, 2)
        value.update(extra)
        return value

    def announce(self, outer_step: int | None = None, averaging: bool | None = None, held: Any = None,
                 wait: bool = True) -> None:
        """Publish (or refresh) this island's registration: its outer step, whether it is averaging, and ``held``:
        the digest of the θ_global it holds at its position (see :attr:`Member.held`), given with its new outer step
        (the one it averages from, when it starts averaging).  ``wait`` False: the record changes now and is stored
        by a thread of its own (a store costs a blocking round's training thread 5-30 ms)."""
        if outer_step is not None:
            self.outer_step = outer_step
            self.held = held
        if averaging is not None:
            self.averaging = averaging
        self.forget_read()  # the next question reads the registry again, this record in it
        if not wait:
            threading.Thread(target=self._publish, args=(True,), name="diloco-announce", daemon=True).start()
            return
        self._publish()

    def _publish(self, quiet: bool = False) -> None:
        """Store this island's record as it stands now.  One store at a time, each of the fields as they are when it
        starts: the store that lands last holds the newest (a heartbeat's value read before an announce, stored
        after it, hid the announce until the next beat).  ``quiet``: a thread of its own, which the DHT may outlive."""
        with self._store_lock:
            if self._stop.is_set():
                return  # it left: a record stored now would bring it back
            try:
                self._store(self._value(), self.ttl)
            except DHTUnavailableError as e:  # a DHT that no longer answers must not stop training or leaving
                log.warning("could not refresh this island's registration: %s", e)
            except Exception as e:
                if not quiet:
                    raise
                log.debug("could not refresh this island's registration: %s", e)

    def _store(self, value: dict, ttl: float) -> None:
        store_owned(self.dht, self.key, value, get_dht_time() + ttl, timeout=ttl)

    def start_heartbeat(self) -> None:
        """Refresh the registration every :attr:`period` seconds in a daemon thread, counted from the start of the
        last refresh: a store that takes seconds on a loaded machine (32 islands on 2 cores) must not stretch the
        period past what :meth:`beating` allows."""
        self.announce()

        def beat() -> None:
            started = time.monotonic()
            while not self._stop.wait(max(0.0, self.period - (time.monotonic() - started))):
                started = time.monotonic()
                try:
                    self.announce()
                except Exception as e:  # the DHT may be shutting down
                    log.debug("heartbeat failed: %s", e)

        self._thread = threading.Thread(target=beat, name="diloco-heartbeat", daemon=True)
        self._thread.start()

    def leave(self) -> None:
        """Tell the run this island is gone, so nobody waits for it."""
        self._stop.set()
        with self._store_lock:  # after a store in flight, never before it: the record that lands last says it left
            try:
                self._store(self._value(averaging=False, left=True),
                            FINAL_RECORD_TTL if self.final is not None else self.ttl + 1)
            except Exception as e:
                log.debug("could not announce leaving: %s", e)

    def members(self, strict: bool = False, timeout: float | None = None) -> dict[str, Member]:
        """Registered peers (every rank of every island, including those that announced leaving), by peer id;
        none when the DHT cannot answer within ``timeout`` (default: the ttl; ``strict``: raise
        :class:`DHTUnavailableError` then).  A read younger than :attr:`fresh` seconds answers instead."""
        with self._read_lock:
            read = self._read
        if read is not None and time.monotonic() - read[0] < self.fresh:
            return dict(read[1])
        out: dict[str, Member] = {}
        started, announced, read_at = time.monotonic(), self._announced, get_dht_time()
        try:
            found = dht_get(self.dht, self.key, timeout=self.ttl if timeout is None else timeout, beam_size=READ_BEAM)
        except DHTUnavailableError as e:
            if strict:
                raise
            log.warning("could not look up the run's islands: %s", e)
            return out
        for pid, (value, expiration) in owned_items(found, self.key).items():
            if isinstance(value, dict):
                try:
                    rank = int(value.get("rank", 0))
                except (TypeError, ValueError):
                    rank = 0
                maddrs = value.get("maddrs")
                out[pid] = Member(pid, int(value.get("outer_step", 0)), bool(value.get("left", False)),
                                  bool(value.get("averaging", False)), str(value.get("island") or pid), rank,
                                  tuple(str(a) for a in maddrs) if isinstance(maddrs, list) else (),
                                  value.get("final"), expiration,
                                  str(value.get("endpoint", "")), bool(value.get("serving", True)),
                                  _count(value.get("committed")), value.get("held"), read_at,
                                  _seconds(value.get("beat")))
        with self._read_lock:
            # a record an earlier read brought, still before its expiry, that this read missed: the read did not reach
            # the replicas holding it (a store whose calls timed out under load reaches fewer of them), which is no
            # departure (an island that leaves says so in its record, and a dead one's address refuses connections).
            # It stays until it expires, as this read's: so its age counts to now (beating and silent judge it by
            # the refresh this read did not see), what hivemind's caches did for a small DHT without their copies
            # of the whole registry answering every look-up
            self._seen = {pid: replace(m, read_at=read_at) for pid, m in self._seen.items() if m.expires > read_at} | out
            out = dict(self._seen)
            self.registry_size = max(1, len(out))
            if self._announced == announced:
                self._read = (started, out)
        return dict(out)

    def islands(self, strict: bool = False) -> dict[str, Member]:
        """Live islands by island id, one :class:`Member` each (``peer_id`` is the island id): the
        highest outer step any of its live ranks announced, averaging if any rank is, the digest of the θ_global
        held by a rank at the furthest position (a rank whose new record is not stored yet still shows the one it
        entered the previous round with), and its rank 0's endpoint.  An island whose address refused a
        connection (:meth:`company`) is left out until its record is refreshed again (it restarted)."""
        out: dict[str, Member] = {}
        for m in self.members(strict).values():
            if m.left:
                continue
            island = m.island or m.peer_id
            seen = out.get(island)
            if seen is None:
                out[island] = seen = Member(island, m.outer_step, False, m.averaging, island, 0,
                                            expires=m.expires, serving=m.serving, committed=m.committed, held=m.held,
                                            read_at=m.read_at)
            else:
                if m.position > seen.position or (m.position == seen.position and seen.held is None):
                    seen.held = m.held
                seen.outer_step = max(seen.outer_step, m.outer_step)
                seen.committed = max(seen.committed, m.committed)
                seen.averaging = seen.averaging or m.averaging
                seen.expires = max(seen.expires, m.expires)
                seen.serving = seen.serving and m.serving
            if m.rank == 0:
                seen.endpoint = m.endpoint
        return {island: m for island, m in out.items() if not self._is_gone(m)}

    def _is_gone(self, m: Member) -> bool:
        """Whether island ``m``'s address refused us and its record was not refreshed since."""
        return m.peer_id in self._gone and m.expires <= self._gone[m.peer_id]

    def snapshot(self, outer_step: int, timeout: float | None = None) -> Snapshot:
        """Read the registry once for round ``outer_step`` (waiting at most ``timeout`` seconds for the DHT; then
        this island sees itself only): who is live and where, who comes to the round, and who is known not to
        (see :class:`Snapshot`)."""
        records = self.members(timeout=timeout)
        live: dict[str, Member] = {}
        absent: set[str] = set()
        for m in records.values():
            island = m.island or m.peer_id
            if m.left:
                if m.outer_step <= outer_step:
                    absent.add(island)
                continue
            seen = live.get(island)
            if seen is None or m.rank == 0:
                live[island] = m
        for island in [i for i in live if i in absent]:  # an island that left and came back: live again
            absent.discard(island)
        for island, m in list(live.items()):
            if island != self.island and island in self._gone and m.expires <= self._gone[island]:
                del live[island]
                if m.outer_step <= outer_step:
                    absent.add(island)
        endpoints = {i: m.endpoint for i, m in live.items() if m.rank == 0 and m.endpoint}
        # an island whose record still shows the round before is finishing it (or its record is not yet refreshed):
        # islands that read the registry a moment apart then still count it alike
        coming = {i for i, m in live.items() if outer_step - 1 <= m.outer_step <= outer_step} | {self.island}
        return Snapshot(endpoints, coming, absent, max(1, len(live | {self.island: None})))

    def endpoints(self, island: str) -> list[str]:
        """The transport endpoints of ``island``'s live ranks, by rank ([] if a rank has none or is missing)."""
        ranks = sorted((m.rank, m.endpoint) for m in self.members().values()
                       if (m.island or m.peer_id) == island and not m.left)
        if not ranks or any(not e for _, e in ranks) or [r for r, _ in ranks] != list(range(len(ranks))):
            return []
        return [e for _, e in ranks]

    def reachable_others(self) -> int:
        """Live islands other than this one whose ranks take incoming connections (their transport endpoints
        are not lanes: see :mod:`peers.wire.transport`), i.e. those that can carry the bytes of islands behind
        NAT."""
        return len({m.island or m.peer_id for m in self.members().values()
                    if m.reachable() and (m.island or m.peer_id) != self.island})

    def others(self, strict: bool = False) -> list[Member]:
        """Live islands other than this one (one entry per island, however many ranks it has)."""
        return [m for island, m in self.islands(strict).items() if island != self.island]

    def beating(self, m: Member) -> bool:
        """Whether ``m`` refreshed its record within its last heartbeat period (plus a little for a slow DHT): an
        island that missed a beat may have died without leaving, though its record lives on until the ttl runs
        out."""
        period = self._period_of(m)
        return self._unrefreshed(m) < period + min(2.0, period / 2)

    def silent(self, m: Member) -> bool:
        """Whether ``m`` missed two heartbeats: unlike a record merely late (a loaded machine, a slow DHT), one
        whose refreshes no longer reach this island's DHT (the island died, or a partition keeps them away)."""
        period = self._period_of(m)
        return self._unrefreshed(m) > 2 * period + min(2.0, period / 2)

    def _period_of(self, m: Member) -> float:
        """The heartbeat period ``m`` published (:attr:`Member.beat`), within this run's bounds."""
        return min(self.ttl / 3, max(self._shortest_period, m.beat))

    def _unrefreshed(self, m: Member) -> float:
        """Seconds ``m``'s record had gone without a refresh when the read that brought it started."""
        return self.ttl - (m.expires - (m.read_at or get_dht_time()))

    def furthest(self, beating_only: bool = False) -> Position:
        """The furthest :data:`Position` the run confirms (:func:`confirmed_position`) from the other live islands'
        records ((-1, -1) if none); ``beating_only``: among those still beating (a killed island's record, at a
        step nobody else reached, lives on until the ttl runs out, and nobody can serve that step)."""
        return confirmed_position([m.position for m in self.others() if not beating_only or self.beating(m)])

    def vouched_state(self, position: Position, others: list[Member] | None = None) -> tuple[list[float] | None, int]:
        """The digest of the θ_global that the other live islands at ``position`` hold (:attr:`Member.held`, in
        their own signed records), and how many of them agree on it: the largest agreeing set's (ties: the one
        holding the smallest island id); (None, 0) when none announces one.  What a state downloaded at that
        position must match.  ``others``: the other live islands as :meth:`others` just read them (default: read
        the registry again)."""
        meta = {m.island: {"state_fingerprint": m.held} for m in (self.others() if others is None else others)
                if m.position == position and isinstance(m.held, list) and self.beating(m)}
        if not meta:
            return None, 0
        agreeing, _ = majority_by_state(meta, sorted(meta)[0])
        return list(meta[agreeing[0]]["state_fingerprint"]), len(agreeing)

    def meeting_step(self, committed: int, outer_step: int) -> int:
        """The round this island, at outer step ``outer_step`` with ``committed`` rounds in its lineage, averages next
        (see :func:`meeting_step`), from the live islands still beating."""
        return meeting_step([m.outer_step for m in self.others() if m.committed == committed and self.beating(m)],
                            outer_step)

    def averaging_round(self, outer_step: int) -> bool:
        """True if another live island announced it is averaging round ``outer_step`` right now."""
        return any(m.averaging and m.outer_step == outer_step for m in self.others())

    def addresses(self) -> list[str]:
        """Multiaddrs of every live peer of the run but this island's own ranks (to find them again)."""
        return sorted({a for m in self.members().values() if not m.left and m.island != self.island
                       for a in m.maddrs})

    def round_size(self, outer_step: int) -> int:
        """Islands (this one included) that will average round ``outer_step``: the live ones at that outer
        step, averaging it already or still training towards it (whether a round that formed no group is worth
        waiting for once more)."""
        return 1 + sum(m.outer_step == outer_step for m in self.others())

    def outvoted(self, outer_step: int, state: Any, wait: float,
                 arrived: Callable[[], Mapping[str, list[float] | None]] = dict) -> bool:
        """Whether our fingerprint ``state`` of the θ_global we enter round ``outer_step`` with disagrees
        with the majority of the islands entering it too (their registry records; we wait up to ``wait``
        seconds for islands at that step still training).  Ties go to the side holding the smallest
        island id, so every island reaches the same verdict.  Compared as digests (:attr:`Member.held`): the
        registry carries no island's whole fingerprint (a 1b model's is 3,600 floats, read by every island about once
        a second).  ``arrived()``: islands known to have reached the round meanwhile (they asked this island to join
        it) → the digest they enter it with, as their join said (None: not said): the wait for them ends then."""
        deadline = time.monotonic() + wait
        came: Mapping[str, list[float] | None] = {}
        while True:
            others = self.others()
            pending = {m.island for m in others if m.outer_step == outer_step and not m.averaging}
            look = min(deadline, time.monotonic() + 0.5)
            while True:  # until the islands waited for ask to join, or the registry's next look
                came = arrived()
                told = {i for i, d in came.items() if d is not None}
                if pending <= told or time.monotonic() >= look:
                    break
                time.sleep(0.01)  # the last comer, leading, waits for this island's join meanwhile
            if pending <= told or time.monotonic() >= deadline:
                break
        meta = {m.peer_id: {"state_fingerprint": m.held} for m in others
                if m.averaging and m.outer_step == outer_step and isinstance(m.held, list)}
        meta.update({i: {"state_fingerprint": d} for i, d in came.items() if d is not None})
        if not meta:
            return False
        meta[self.island] = {"state_fingerprint": digest(state)}
        return majority_by_state(meta, self.island)[1]

    def final_disagreements(self, outer_step: int, state: Any, wait: float) -> tuple[list[str], int]:
        """Publish that this island ended at ``outer_step`` with θ_global fingerprint ``state``; return the
        other islands that ended at the same step with another one (waiting up to ``wait`` seconds for
        live islands at that step to finish too), and how many ended there at all.  Records keep it
        after an island leaves (until they expire)."""
        mine = digest(state)
        self.final = {"outer_step": outer_step, "state": mine}
        self.announce()
        deadline = time.monotonic() + wait
        while True:
            records = [m for m in self.members().values() if m.island != self.island]
            pending = [m for m in records if not m.left and m.final is None and m.outer_step >= outer_step]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        ended = [m for m in records if isinstance(m.final, dict) and m.final.get("outer_step") == outer_step]
        return (sorted({m.island for m in ended if not fingerprints_agree(m.final.get("state") or [], mine, 1e-5)}),
                len({m.island for m in ended}))

    def ended_at(self) -> int | None:
        """The outer step the run ended at, when every other island's record says that it finished the run and
        left; None while one of them is live or none finished (or no other island ever registered)."""
        records = [m for m in self.members().values() if (m.island or m.peer_id) != self.island]
        if not records or not all(m.left for m in records):
            return None
        steps = [m.final.get("outer_step") for m in records if isinstance(m.final, dict)]
        steps = [int(step) for step in steps if isinstance(step, int)]
        return max(steps) if steps else None

    def moved_past(self, outer_step: int) -> bool:
        """Whether the run moved past this island's round ``outer_step`` (see :func:`run_moved_past`), from the
        positions the other live islands announced.  Answers from the registry as a background look-up read it (every
        :attr:`fresh` seconds while asked), so a slow DHT never blocks the caller."""
        return run_moved_past(self._looked() or [], (self.committed_rounds(), outer_step))

    def numbers_ahead(self, outer_step: int) -> bool:
        """Whether this island, about to average its round ``outer_step``, numbers it past the run (see
        :func:`run_numbers_behind`), from the positions the other live islands announced (as :meth:`moved_past`)."""
        return run_numbers_behind(self._positions(), (self.committed_rounds(), outer_step))

    def company(self) -> int:
        """How many other islands are live and not gone: registered, and their rank 0's address (when it takes
        connections) did not refuse one.  A SIGKILLed island's record lives on until its ttl runs out, but
        nothing listens at its address from the moment it died: an island looking for a group stops waiting
        for it (or for every other island killed at once) within a look instead of ``matchmaking_timeout``.
        Answers from the background look-up of :meth:`moved_past` (which probes the addresses, once a second
        while asked); the first question reads the registry itself."""
        # a registry that cannot answer raises (strict): the caller cannot tell, and counts company
        return len(self._positions(strict=True))

    def _positions(self, strict: bool = False) -> list[Position]:
        """The other live islands' positions as the background look-up last read them (:meth:`_looked`), or, before
        its first look, as a read of the registry finds them now."""
        steps = self._looked()
        return [m.position for m in self.others(strict)] if steps is None else steps

    def _looked(self) -> list[Position] | None:
        """The positions of the other live islands that are not gone, as the background look-up last read
        them (None before its first look), and keep it looking for 5 s more."""
        with self._steps_lock:
            self._steps_wanted = time.monotonic()
            steps = self._steps
            if self._steps_thread is None or not self._steps_thread.is_alive():
                self._steps_thread = threading.Thread(target=self._read_steps, name="registry-steps", daemon=True)
                self._steps_thread.start()
        return steps

    def _read_steps(self) -> None:
        while not self._stop.is_set() and time.monotonic() - self._steps_wanted < 5.0:
            try:
                others = self.others(strict=True)
            except DHTUnavailableError as e:  # cannot tell: keep the last look rather than count nobody
                log.debug("registry look-up failed: %s", e)
            else:
                if self.refuses is not None:
                    for m in others:
                        if self.refuses(m.endpoint):
                            log.info("island %s is gone: nothing listens at its address %s", m.peer_id[-8:],
                                     m.endpoint)
                            self._gone[m.peer_id] = m.expires
                steps = [m.position for m in others if not self._is_gone(m)]
                with self._steps_lock:
                    self._steps = steps
            self._stop.wait(FRESH)  # the addresses are probed each time; the registry is read when its last read is stale
        with self._steps_lock:
            self._steps = None  # nobody asked for a while: a later question waits for a fresh look

    def live_count(self) -> int:
        """Distinct islands registered and not departed (at least 1: ourselves)."""
        return max(1, len(self.islands()))


def reachable_islands(dht: hivemind.DHT, prefix: str, timeout: float, most: int = 2) -> list[str]:
    """The transport endpoints of up to ``most`` registered islands that take incoming connections (their
    first ranks' endpoints are not lanes), waiting up to ``timeout`` seconds for one to register: what an
    island joining the run asks to connect back to it (:mod:`peers.wire.dial_back`).

    Islands that all join at once through a bare bootstrap node would each wait for another to register
    first: those waiting say so under ``<prefix>.waiting``, and the one of them with the smallest peer id stops
    waiting ([]: it learns nothing, and registers), so that the others can ask it."""
    me, key = str(dht.peer_id), f"{prefix}.waiting"
    deadline = time.monotonic() + timeout
    members = Membership(dht, prefix)
    while True:
        endpoints = sorted(m.endpoint for m in members.members().values()
                           if m.rank == 0 and m.reachable() and m.island != me)
        if endpoints or time.monotonic() >= deadline:
            return endpoints[:most]
        try:
            store_owned(dht, key, True, get_dht_time() + 10.0, timeout=5.0)
            waiting = sorted(owned_items(dht_get(dht, key, timeout=5.0), key))
        except DHTUnavailableError:
            waiting = []
        if len(waiting) > 1 and waiting[0] == me:
            return []
        time.sleep(0.2)


def is_registered(dht: hivemind.DHT, prefix: str, peer_id: str) -> bool:
    """True if ``peer_id`` holds a live (validated) registration in the run's member registry."""
    try:
        return peer_id in registered(dht_get(dht, f"{prefix}.members", timeout=30.0), f"{prefix}.members")
    except DHTUnavailableError:
        return False


def registered(found: Any, key: str) -> set[str]:
    """Peer ids holding a live registration of their own in a lookup of the member registry ``key``."""
    return {pid for pid, (value, _) in owned_items(found, key).items()
            if isinstance(value, dict) and not value.get("left", False)}


class MemberCheck:
    """Is a peer registered in the run's member registry (DHT key ``key``)?  Members once seen are
    cached; an unknown peer costs one DHT lookup.  Async, holding no loop-bound state, so the
    averager's process and the vote channel's loop can both use it."""

    def __init__(self, dht: hivemind.DHT, key: str):
        self.dht, self.key = dht, key
        self._known: set[str] = set()

    async def allows(self, peer_id: str) -> bool:
        """True when ``peer_id`` is (or was, earlier in this process) a registered member."""
        if peer_id in self._known:
            return True
        self._known |= registered(await self.dht.get(self.key, latest=True, return_future=True), self.key)
        if peer_id not in self._known:
            log.warning("refused a request from %s: not a member of this run", peer_id)
            return False
        return True


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
