"""One θ_global at any number of islands, by simulation: a discrete-event model of a round of DiLoCo at 100 to
1,000+ islands, for the roster rounds (groups formed from the run's member registry, a quorum rule and a two-level
exchange), against a flat all-reduce in one group formed by hivemind's matchmaking and against gossip (NoLoCo's
averaging with one random peer)::

    python -m experiments.scale_sim --islands 100,1000 --rtt-ms 100 --churn 0.05 --payload-mb 100 \\
        --rate 1gbit --group-size 16 --rounds 50 --seed 0 [--out DIR] [--calibrate FILE.json]

(or ``diloco experiment scale-sim ...``).  It prints a table per (islands, scheme): the median and 90th percentile
of the round time, the median time an island spends in a round outside its own compute, bytes sent and received
per island per round, rounds committed, retries and deaths; and writes ``results.md``, ``results.json`` and
``scale_sim.png`` to ``--out``.  Every parameter is a field of :class:`Settings` (``--help`` lists them with their
meaning); ``--calibrate FILE.json`` reads any of them from a file of measured per-island figures (the same names),
and flags given on the command line win over the file.

The model, its assumptions and what it ignores are in ``experiments/scale_sim.md``.  In short: each island has
an access link of its own (rate each way, a one-way delay to the core of the network: the round trip between two
islands is the sum of their halves), a message's last byte arrives once its sender's uplink has sent it and the
receiver's downlink has taken it in (the uplink and the downlink shared fluidly among the parts of one phase),
fresh connections pay a handshake and TCP slow start, and CPU work (the inner steps, per-message and per-byte
costs) runs on the island's own core or, in calibration mode (``cores``), on cores shared by every island by
processor sharing.  Pure Python, deterministic given ``--seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from experiments.netns import parse_rate
from experiments.report import format_bytes, markdown_table

SCHEMES = ("roster", "flat", "gossip")
"""``roster``: groups from the member registry, the two-level round, the quorum; ``flat``: one group of every island
formed by hivemind's matchmaking, a flat reduce-scatter + all-gather; ``gossip``: NoLoCo's averaging with one random
peer a round, no global quorum."""
EXCHANGES = ("reduce", "gather")
"""``reduce``: a payload that sums part by part (dense, int8 with fp32 accumulation): reduce-scatter then
all-gather; ``gather``: a payload every member must receive whole (SparseLoCo's top-k): an all-gather."""
DEFAULT_OUT = Path("experiments/results/scale-sim")


class ScaleSimError(ValueError):
    """A setting the simulation cannot use, in one sentence that names it and what to give instead."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class Settings:
    """Every parameter of the simulation.  The names are the keys of a ``--calibrate`` file and, with dashes, the
    command-line flags.  Per-island figures (``step_s``, ``rate``, ``rtt_ms``) take one value (``"1.0"``), a
    range drawn uniformly per island (``"0.5..2"``) or a list handed out to the islands in turn (``"1,1,1,3"``)."""

    islands: list[int] = field(default_factory=lambda: [100, 1000], metadata=_help(
        "Numbers of islands to simulate, each a run of its own."))
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES), metadata=_help(
        "Schemes to simulate: roster (the two-level round), flat (hivemind's matchmaking, one group), gossip."))
    rounds: int = field(default=50, metadata=_help("Outer rounds per run."))
    seed: int = field(default=0, metadata=_help("Seed of every random draw: the same seed gives the same run."))
    payload_mb: float = field(default=100.0, metadata=_help(
        "Bytes one island contributes to a round (its encoded pseudo-gradient), in MB (10^6 bytes)."))
    exchange: str = field(default="reduce", metadata=_help(
        "reduce: the payload sums part by part (reduce-scatter + all-gather); gather: every member needs every "
        "payload whole (an all-gather; flat and gossip only)."))
    group_size: int = field(default=16, metadata=_help(
        "G: the roster is split into ceil(n/G) groups of near-equal size (roster scheme)."))
    inner_steps: int = field(default=100, metadata=_help("H: inner steps an island computes per round."))
    step_s: str = field(default="0.5", metadata=_help(
        "Seconds of one inner step, per island, with the island alone on its cores (stragglers: a range or list)."))
    step_jitter: float = field(default=0.05, metadata=_help(
        "Sigma of a lognormal factor (mean 1) drawn per island and round on its compute time."))
    rate: str = field(default="1gbit", metadata=_help(
        "Each island's access link, each way (e.g. 1gbit, 100mbit..1gbit, or a list)."))
    rtt_ms: str = field(default="100", metadata=_help(
        "Round trip between two islands, in ms; per island, the round trip between i and j is the mean of theirs."))
    churn: float = field(default=0.05, metadata=_help(
        "Probability that an island dies during a round (at a uniform moment of its previous round's length)."))
    silent_fraction: float = field(default=0.2, metadata=_help(
        "Share of deaths in which the host vanished silently (found only after silent_timeout)."))
    silent_timeout: float = field(default=30.0, metadata=_help(
        "Seconds before the others give up on a member whose host vanished silently."))
    refused_s: float = field(default=1.0, metadata=_help(
        "Seconds before the others learn of a member whose process died (connection refused or reset)."))
    restart_s: float = field(default=60.0, metadata=_help("Seconds before a dead island is running again."))
    state_factor: float = field(default=2.0, metadata=_help(
        "A catching-up island downloads state_factor x payload bytes (θ_global and the outer state) from one donor."))
    retries: int = field(default=1, metadata=_help(
        "Attempts of a round after a failed one (survivors go round again without the members found gone)."))
    matchmaking_time: float = field(default=5.0, metadata=_help(
        "Seconds the leader waits, after a majority of the last committed roster joined, for the islands it "
        "expects (both roster and flat: hivemind's own rule would split the run into groups)."))
    round_timeout: float = field(default=120.0, metadata=_help(
        "Seconds after its first join at which a leader closes its roster whatever joined (no quorum: no commit)."))
    heartbeat_s: float = field(default=3.0, metadata=_help(
        "Seconds between an island's heartbeats: a record whose last beat is two periods old is not live."))
    record_ttl: float = field(default=60.0, metadata=_help(
        "Seconds a dead island's record stays in the registry, returned by every read (--averaging.member_ttl)."))
    registry_rtts: float = field(default=2.0, metadata=_help("Round trips of a registry read (a DHT get)."))
    dht_replicas: int = field(default=3, metadata=_help("DHT nodes a registry read gets the records from."))
    record_bytes: int = field(default=400, metadata=_help("Bytes of one registration in a registry read."))
    join_bytes: int = field(default=1000, metadata=_help("Bytes of a join (an island's metadata)."))
    id_bytes: int = field(default=60, metadata=_help("Bytes of one member's id in the roster."))
    verdict_bytes: int = field(default=200, metadata=_help("Bytes of one verdict of the vote."))
    hivemind_rtts: float = field(default=5.7, metadata=_help(
        "Round trips from an island's arrival to its group with hivemind's matchmaking (measured: 5.7 at 250 ms)."))
    reuse_connections: bool = field(default=True, metadata=_help(
        "Connections to a peer stay open across rounds (false: every round opens fresh ones)."))
    handshake_rtts: float = field(default=2.0, metadata=_help(
        "Round trips to open a connection (TCP, then the key exchange of the sealed transport)."))
    initial_window: int = field(default=14600, metadata=_help("Bytes of TCP's initial window (10 segments)."))
    cores: float = field(default=0.0, metadata=_help(
        "0: every island has cores of its own; C > 0: all islands share C cores (one machine), CPU work slowed "
        "by processor sharing (calibration mode)."))
    background_cpu: float = field(default=0.0, metadata=_help(
        "Cores each island's daemons (DHT, p2pd, heartbeats) keep busy; shared cores only."))
    cpu_per_message_s: float = field(default=50e-6, metadata=_help(
        "CPU seconds per message sent or received (framing, syscalls, the event loop)."))
    cpu_per_byte_s: float = field(default=1.4e-9, metadata=_help(
        "CPU seconds per payload byte sent or received (encode, seal, open, decode, sum; measured for fp32 on this "
        "machine: 0.453 s to exchange 160 MB each way, docs/averaging.md)."))
    round_overhead_s: float = field(default=0.0, metadata=_help(
        "CPU seconds per committed round outside the exchange (the outer step, the fingerprint)."))
    partition: float = field(default=0.0, metadata=_help(
        "Share of the islands cut off from the others for the whole run (0: none)."))
    spread_threshold: float = field(default=0.01, metadata=_help(
        "Gossip: the spread of θ across islands, relative to its start, below which it counts as one model."))

    def check(self) -> None:
        """Raise :class:`ScaleSimError` on the first setting the simulation cannot use."""
        if not self.islands or min(self.islands) < 2:
            raise ScaleSimError(f"--islands needs numbers of 2 or more, got {self.islands}")
        for s in self.schemes:
            if s not in SCHEMES:
                raise ScaleSimError(f"--schemes has unknown scheme {s!r}: use {', '.join(SCHEMES)}")
        if self.exchange not in EXCHANGES:
            raise ScaleSimError(f"--exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        if self.exchange == "gather" and "roster" in self.schemes:
            raise ScaleSimError("--exchange gather has no two-level round (every island receives all n payloads "
                                "whatever the groups): drop roster from --schemes or use --exchange reduce")
        positive = {"rounds": self.rounds, "payload_mb": self.payload_mb, "group_size": self.group_size - 1,
                    "inner_steps": self.inner_steps, "dht_replicas": self.dht_replicas,
                    "initial_window": self.initial_window}
        for name, value in positive.items():
            if value <= 0:
                raise ScaleSimError(f"--{name.replace('_', '-')} must be more than "
                                    f"{'1' if name == 'group_size' else '0'}, got {getattr(self, name)}")
        for name in ("churn", "silent_fraction", "partition"):
            if not 0 <= getattr(self, name) < 1:
                raise ScaleSimError(f"--{name.replace('_', '-')} must be at least 0 and below 1, "
                                    f"got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and (not math.isfinite(value) or value < 0):
                raise ScaleSimError(f"--{f.name.replace('_', '-')} must be a finite number of 0 or more, got {value}")
        if self.retries < 0:
            raise ScaleSimError(f"--retries must be 0 or more, got {self.retries}")
        per_island("step_s", self.step_s, 2, random.Random(0), float)
        per_island("rate", self.rate, 2, random.Random(0), parse_rate)
        per_island("rtt_ms", self.rtt_ms, 2, random.Random(0), float)

    @property
    def payload(self) -> float:
        return self.payload_mb * 1e6


def per_island(name: str, spec: str, n: int, rng: random.Random, parse: Callable[[str], float]) -> list[float]:
    """``n`` values of a per-island figure: one value for all, ``lo..hi`` drawn uniformly per island, or a
    comma-separated list handed out in turn."""
    try:
        if ".." in spec:
            lo, hi = (parse(x.strip()) for x in spec.split("..", 1))
            if hi < lo:
                raise ValueError(f"{hi} is below {lo}")
            values = [rng.uniform(lo, hi) for _ in range(n)]
        else:
            items = [parse(x.strip()) for x in spec.split(",") if x.strip()]
            if not items:
                raise ValueError("no value")
            values = [items[i % len(items)] for i in range(n)]
    except ValueError as e:
        raise ScaleSimError(f"--{name.replace('_', '-')} {spec!r} is not a value, a range lo..hi or a list a,b,c "
                            f"({e})") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ScaleSimError(f"--{name.replace('_', '-')} {spec!r} must be finite and not negative")
    return values


# ---- the event loop and the CPU ------------------------------------------------------------------------------

class Loop:
    """Events in time order (ties in the order they were scheduled): a run is deterministic given its seed."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def run(self) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


@dataclass(eq=False)
class View:
    """A committed roster as an island knows it, with the order in which it picks each round's leader."""

    roster: tuple[int, ...]
    members: frozenset[int] = frozenset()
    orders: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.members = frozenset(self.roster)

    @property
    def majority(self) -> int:
        return len(self.roster) // 2 + 1

    def order(self, r: int) -> list[int]:
        """The roster by a hash of (round, island): the candidates for round ``r``'s leader, in turn."""
        if r not in self.orders:
            self.orders.clear()
            self.orders[r] = sorted(self.roster, key=lambda j: zlib.crc32(f"{r}:{j}".encode()))
        return self.orders[r]


@dataclass(eq=False)
class Island:
    """One island's state.  ``life`` changes when it dies and when it restarts; ``epoch`` also when it abandons
    an attempt: an event scheduled under an older value is dropped."""

    id: int
    step_s: float
    rate: float
    """Bytes/s of its access link, each way."""
    lat: float
    """One-way seconds to the core of the network (the round trip to island j is 2 (lat + j.lat))."""
    side: int = 0
    alive: bool = True
    life: int = 0
    epoch: int = 0
    round: int = 0
    up_free: float = 0.0
    down_free: float = 0.0
    warm: set[int] = field(default_factory=set)
    """Peers it has sent to over a connection still open: that direction's TCP window is open."""
    gone: dict[int, int] = field(default_factory=dict)
    """Islands it knows to be gone, with the ``life`` they had then (a restart makes them new)."""
    view: View | None = None
    """The last committed roster it knows of."""
    reg_step: float = 0.0
    """The round its registration says it is heading for."""
    stale_at: float = math.inf
    """When its registration stops counting as live (two heartbeats after the last one: never while alive)."""
    silent: bool = False
    death_pending: bool = False
    round_start: float = 0.0
    compute_end: float = 0.0
    last_round_s: float = 0.0
    attempt: Gathering | Attempt | Collective | None = None
    """What it takes part in now: a leader's gathering, a closed roster, a gossip exchange."""
    sent: float = 0.0
    received: float = 0.0


class Cpu:
    """Where CPU work runs: on each island's own core (``cores`` = 0: a job takes its work in seconds), or on
    ``cores`` shared by all islands, by processor sharing (each job single-threaded: its speed is
    min(1, cores / jobs running))."""

    def __init__(self, loop: Loop, cores: float) -> None:
        self.loop, self.cores = loop, cores
        self._jobs: dict[int, list] = {}
        self._next_id = 0
        self._last = 0.0
        self._version = 0
        self.work: dict[int, float] = {}
        """CPU seconds asked for, per island: what calibration counts the model's messages with."""

    def run(self, isl: Island, work: float, fn: Callable[..., None], *args: Any, server: bool = False) -> None:
        """Run ``work`` CPU seconds for ``isl``, then ``fn(*args)`` unless the island died (or, unless ``server``,
        abandoned what it was doing) meanwhile."""
        guard = (isl, isl.life, None if server else isl.epoch)
        self.work[isl.id] = self.work.get(isl.id, 0.0) + max(work, 0.0)
        if self.cores <= 0 or work <= 0:
            self.loop.at(self.loop.now + max(work, 0.0), self._fire, guard, fn, args)
            return
        self._advance()
        self._jobs[self._next_id] = [work, guard, fn, args]
        self._next_id += 1
        self._schedule()

    def cancel(self, isl: Island) -> None:
        """Drop the jobs of an island that died."""
        if self._jobs:
            self._advance()
            for k in [k for k, j in self._jobs.items() if j[1][0] is isl]:
                del self._jobs[k]
            self._schedule()

    @staticmethod
    def _fire(guard: tuple, fn: Callable[..., None], args: tuple) -> None:
        isl, life, epoch = guard
        if isl.life == life and (epoch is None or isl.epoch == epoch):
            fn(*args)

    def _speed(self) -> float:
        return min(1.0, self.cores / len(self._jobs)) if self._jobs else 1.0

    def _advance(self) -> None:
        done = (self.loop.now - self._last) * self._speed()
        for job in self._jobs.values():
            job[0] -= done
        self._last = self.loop.now

    def _schedule(self) -> None:
        self._version += 1
        if self._jobs:
            left = min(j[0] for j in self._jobs.values())
            self.loop.at(self.loop.now + max(left, 0.0) / self._speed(), self._tick, self._version)

    def _tick(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        finished = [k for k, j in self._jobs.items() if j[0] <= 1e-9]
        jobs = [self._jobs.pop(k) for k in finished]
        self._schedule()
        for _, guard, fn, args in jobs:
            self._fire(guard, fn, args)


# ---- links --------------------------------------------------------------------------------------------------

def slow_start_seconds(size: float, rate: float, rtt: float, initial_window: float) -> float:
    """Seconds a fresh TCP connection takes beyond a warm one to move ``size`` bytes at ``rate`` bytes/s over a
    round trip of ``rtt``: its window starts at ``initial_window`` and doubles every round trip until it covers
    rate × rtt; while it is smaller, each window's worth waits a round trip for its acknowledgements."""
    if rtt <= 0 or size <= 0:
        return 0.0
    t, window, left = 0.0, float(initial_window), float(size)
    while left > 0 and window < rate * rtt:
        chunk = min(window, left)
        left -= chunk
        t += rtt if left > 0 else chunk / rate
        window *= 2
    return max(0.0, t + left / rate - size / rate)


class Collective:
    """One phase of an exchange: every sender sends ``part`` bytes to every receiver but itself.  A sender's
    parts leave its uplink together (shared fluidly) once its CPU encoded them; a receiver has them when the last
    sender's last byte crossed the network, and not before its downlink could take all of them in."""

    def __init__(self, sim: "Sim", senders: Sequence[int], receivers: Sequence[int], part: float,
                 payload: bool, server: bool = False) -> None:
        self.sim, self.part, self.payload, self.server = sim, part, payload, server
        self.senders, self.receivers = list(senders), set(receivers)
        self.sender_set = set(senders)
        self._sent: dict[int, tuple[float, float]] = {}
        self.arrival: dict[int, float] = {}
        self._waiting: dict[int, tuple[Callable[..., None], tuple, int, int]] = {}
        self._opened: list[tuple[int, set[int]]] = []
        """Directions this phase opened: warm for the phases after it (not for its other senders)."""

    def peers(self, i: int) -> int:
        return len(self.receivers) - (i in self.receivers)

    def sources(self, i: int) -> int:
        return len(self.sender_set) - (i in self.sender_set)

    def send(self, i: int, then: Callable[[], None]) -> None:
        """Island ``i`` encodes and sends its parts, then goes on with ``then`` (without waiting for its uplink)."""
        sim, isl = self.sim, self.sim.islands[i]
        n = self.peers(i)
        work = sim.s.cpu_per_message_s * n + sim.s.cpu_per_byte_s * self.part * n
        sim.cpu.run(isl, work, self._sent_by, i, then, server=self.server)

    def _sent_by(self, i: int, then: Callable[[], None]) -> None:
        sim, isl = self.sim, self.sim.islands[i]
        n = self.peers(i)
        start = max(sim.loop.now, isl.up_free)
        end = start + self.part * n / isl.rate
        if n:
            fresh = self.receivers - isl.warm
            fresh.discard(i)
            if fresh:
                far = max(sim.islands[j].lat for j in fresh)
                end += sim.open_seconds(isl, fresh, far, self.part, isl.rate / n)
                self._opened.append((i, fresh))
        isl.up_free = end
        sim.count(isl, self.part * n, sent=True, payload=self.payload)
        self._sent[i] = (start, end)
        if len(self._sent) == len(self.senders):
            self._complete()
        then()

    def _complete(self) -> None:
        for i, fresh in self._opened:
            self.sim.warm_up(i, fresh)
        islands = self.sim.islands
        firsts = sorted((start + islands[j].lat, j) for j, (start, _) in self._sent.items())[:2]
        lasts = sorted(((end + islands[j].lat, j) for j, (_, end) in self._sent.items()), reverse=True)[:2]
        for i in self.receivers:
            isl = islands[i]
            count = self.sources(i)
            if count == 0:
                self.arrival[i] = self._sent.get(i, (self.sim.loop.now, self.sim.loop.now))[1]
            else:
                last = lasts[0][0] if lasts[0][1] != i else lasts[1][0]
                first = firsts[0][0] if firsts[0][1] != i else firsts[1][0]
                size = self.part * count
                a = max(last + isl.lat, max(first + isl.lat, isl.down_free) + size / isl.rate)
                isl.down_free = a
                self.arrival[i] = a
                self.sim.count(isl, size, sent=False, payload=self.payload)
            if i in self._waiting:
                self._deliver(i, *self._waiting.pop(i))

    def receive(self, i: int, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` once island ``i`` has its parts and its CPU decoded them (unless it died or
        abandoned what it was doing meanwhile)."""
        isl = self.sim.islands[i]
        if i in self.arrival:
            self._deliver(i, fn, args, isl.life, isl.epoch)
        else:
            self._waiting[i] = (fn, args, isl.life, isl.epoch)

    def _deliver(self, i: int, fn: Callable[..., None], args: tuple, life: int, epoch: int) -> None:
        sim, isl = self.sim, self.sim.islands[i]
        n = self.sources(i)
        work = sim.s.cpu_per_message_s * n + sim.s.cpu_per_byte_s * self.part * n

        def decode() -> None:
            if isl.life == life and isl.epoch == epoch:
                sim.cpu.run(isl, work, fn, *args)

        sim.loop.at(self.arrival[i], decode)


# ---- the rounds ---------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Gathering:
    """A leader's collection of joins for one attempt of one round."""

    round: int
    attempt: int
    leader: int
    leader_life: int
    view: View
    retry_expected: set[int] | None = None
    """For a retry: the failed roster, less the members found gone (no registry read)."""
    joined: dict[int, float] = field(default_factory=dict)
    expected: set[int] | None = None
    missing: int = 0
    in_view: int = 0
    timer: bool = False
    closed: bool = False


@dataclass(eq=False)
class Attempt:
    """A closed roster: its exchange and its vote."""

    round: int
    index: int
    leader: int
    roster: tuple[int, ...]
    quorum: bool
    closed_at: float
    steps: dict[int, list[tuple[str, Collective]]] = field(default_factory=dict)
    vote: Collective | None = None
    verdicts: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    failed: bool = False
    fail_at: float = math.inf
    view: View | None = None
    """The roster as the view its members take when it commits."""
    groups: list[list[int]] = field(default_factory=list)


@dataclass
class RunResult:
    """What one simulated run measured."""

    islands: int
    scheme: str
    rounds: int
    round_seconds: list[float]
    """roster, flat: seconds between one round's end and the next's (as the last island to finish sees them);
    gossip: each island's own rounds."""
    idle_seconds: list[float]
    """Per island and round: seconds of the round outside the island's own compute."""
    exchange_seconds: list[float]
    """Per island and round that finished its exchange: seconds from its roster's close (gossip: from the pair's
    request) to its last verdict in (gossip: its partner's payload decoded)."""
    sent_bytes: float
    received_bytes: float
    payload_sent_bytes: float
    committed: int
    retries: int
    deaths: int
    late: int
    """Island-rounds missed: the island's join came after its leader closed the roster, or its roster lacked the
    quorum while the run went on (it catches up by downloading θ_global)."""
    max_commits_per_round: int
    island_rounds: int
    """Rounds the islands started computing, all together."""
    finished: int
    """Islands that ended the last round (the others died near the end, or the run stalled)."""
    averaged_fraction: float = float("nan")
    """Gossip: share of island-rounds that averaged with a peer."""
    spread_rounds: float = float("nan")
    steady_spread: float = float("nan")
    sim_seconds: float = 0.0

    def per_island_round(self, total: float) -> float:
        """``total`` bytes per island-round (a round an island started: it dies or misses some)."""
        return total / max(self.island_rounds, 1)

    @property
    def median_round(self) -> float:
        return statistics.median(self.round_seconds) if self.round_seconds else float("nan")

    @property
    def p90_round(self) -> float:
        return quantile(self.round_seconds, 0.9)

    @property
    def seconds_per_commit(self) -> float:
        """Wall-clock of the run per committed round (roster, flat): what one step of θ_global costs."""
        if self.scheme == "gossip" or not self.committed:
            return float("nan")
        return sum(self.round_seconds) / self.committed

    @property
    def median_exchange(self) -> float:
        return statistics.median(self.exchange_seconds) if self.exchange_seconds else float("nan")

    @property
    def median_idle(self) -> float:
        return statistics.median(self.idle_seconds) if self.idle_seconds else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics); NaN when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Sim:
    """One run of ``n`` islands under one scheme."""

    def __init__(self, s: Settings, n: int, scheme: str) -> None:
        self.s, self.n, self.scheme = s, n, scheme
        self.rng = random.Random(f"{s.seed}:{n}:{scheme}")
        spread = random.Random(f"{s.seed}:{n}:islands")  # the same islands under every scheme
        steps = per_island("step_s", s.step_s, n, spread, float)
        rates = per_island("rate", s.rate, n, spread, parse_rate)
        rtts = per_island("rtt_ms", s.rtt_ms, n, spread, float)
        cut = int(round(n * s.partition))
        self.islands = [Island(i, steps[i], rates[i] / 8, rtts[i] / 4000, side=int(i < cut)) for i in range(n)]
        self.mean_lat = sum(isl.lat for isl in self.islands) / n
        self.loop = Loop()
        cores = max(s.cores - s.background_cpu * n, 0.05 * s.cores) if s.cores > 0 else 0.0
        self.cpu = Cpu(self.loop, cores)
        view = View(tuple(range(n)))
        for isl in self.islands:
            isl.view = view
        self.registry: set[int] = set(range(n))
        """Islands with a record in the registry: running, or dead for less than ``record_ttl``."""
        self.gatherings: dict[tuple[int, int, int], Gathering] = {}
        self.led: dict[int, Attempt] = {}
        self.round_end = [0.0] * s.rounds
        self.commit_end = [0.0] * s.rounds
        self.latest: tuple[int, View] | None = None
        """The last commit of the run: its round and its roster."""
        self.durations: list[float] = []
        self.idle: list[float] = []
        self.exchange: list[float] = []
        self.commits = [0] * s.rounds
        self.retries = self.deaths = self.late = self.island_rounds = 0
        self.finished: set[int] = set()
        self.payload_sent = 0.0
        self.waiting_for_round: dict[int, list[tuple[int, int, bool]]] = {}
        """Per round: the islands (id, life, whether it restarted) that catch up when it ends."""
        self.averaged = self.gossip_rounds = 0
        self.matchings: dict[int, dict[int, int]] = {}
        self.ready: set[tuple[int, int]] = set()

    # -- links and bookkeeping
    def count(self, isl: Island, size: float, sent: bool, payload: bool) -> None:
        if sent:
            isl.sent += size
            if payload:
                self.payload_sent += size
        else:
            isl.received += size

    def rtt(self, a: Island, b: Island) -> float:
        return 2 * (a.lat + b.lat)

    def typical_rtt(self, isl: Island) -> float:
        """The round trip from ``isl`` to an island of mean delay (a DHT node, a partner in matchmaking)."""
        return 2 * (isl.lat + self.mean_lat)

    def open_seconds(self, isl: Island, fresh: Iterable[int], far_lat: float, part: float, rate: float) -> float:
        """Seconds beyond a warm send that ``isl`` needs to send ``part`` bytes at ``rate`` to each of ``fresh``
        (directions it has not sent on): slow start, and a handshake where no connection is open either way."""
        rtt = 2 * (isl.lat + far_lat)
        closed = any(isl.id not in self.islands[j].warm for j in fresh)
        return (self.s.handshake_rtts * rtt if closed else 0.0) + slow_start_seconds(
            part, rate, rtt, self.s.initial_window)

    def warm_up(self, i: int, peers: Iterable[int]) -> None:
        """The directions from ``i`` to ``peers`` are open now (and stay open if connections are reused)."""
        if self.s.reuse_connections:
            self.islands[i].warm.update(peers)

    def reachable(self, a: Island, b: Island) -> bool:
        return a.side == b.side

    def detect_seconds(self, isl: Island) -> float:
        return self.s.silent_timeout if isl.silent else self.s.refused_s

    def send_small(self, src: Island, dst: Island, size: float) -> float:
        """Send a control message now; the time its last byte reaches ``dst``."""
        if src is dst:
            return self.loop.now
        t = max(self.loop.now, src.up_free) + size / src.rate + src.lat + dst.lat
        if dst.id not in src.warm and src.id not in dst.warm:
            t += self.s.handshake_rtts * self.rtt(src, dst)
        self.warm_up(src.id, (dst.id,))
        self.count(src, size, sent=True, payload=False)
        self.count(dst, size, sent=False, payload=False)
        return t

    def later(self, isl: Island, t: float, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` at ``t`` unless the island died or abandoned what it was doing meanwhile."""
        life, epoch = isl.life, isl.epoch

        def fire() -> None:
            if isl.life == life and isl.epoch == epoch:
                fn(*args)

        self.loop.at(t, fire)

    # -- the run
    def run(self) -> RunResult:
        t0 = time.perf_counter()
        for isl in self.islands:
            self.start_round(isl, 0)
        self.loop.run()
        if self.scheme == "gossip":
            spans = self.durations
        else:
            ends = [c if c > 0 else e for c, e in zip(self.commit_end, self.round_end)]
            spans = [b - a for a, b in zip([0.0] + ends[:-1], ends) if b > 0 and b > a]
        result = RunResult(
            islands=self.n, scheme=self.scheme, rounds=self.s.rounds, round_seconds=spans, idle_seconds=self.idle,
            exchange_seconds=self.exchange,
            sent_bytes=sum(i.sent for i in self.islands), received_bytes=sum(i.received for i in self.islands),
            payload_sent_bytes=self.payload_sent, committed=sum(1 for c in self.commits if c),
            retries=self.retries, deaths=self.deaths, late=self.late, max_commits_per_round=max(self.commits),
            island_rounds=self.island_rounds, finished=len(self.finished))
        if self.scheme == "gossip":
            result.averaged_fraction = self.averaged / max(self.gossip_rounds, 1)
            result.spread_rounds, result.steady_spread = gossip_spread(self.n, self.s.spread_threshold, self.s.seed)
        result.sim_seconds = time.perf_counter() - t0
        return result

    def start_round(self, isl: Island, r: int) -> None:
        """Compute H inner steps of round ``r`` (and perhaps die during the round)."""
        if r >= self.s.rounds or not isl.alive:
            return
        if self.scheme == "gossip":
            self.release_partners(isl, range(isl.round, r))
        isl.round, isl.round_start, isl.attempt = r, self.loop.now, None
        self.island_rounds += 1
        isl.reg_step = max(isl.reg_step, r)
        work = self.s.inner_steps * isl.step_s
        if self.s.step_jitter > 0:
            sigma = self.s.step_jitter
            work *= math.exp(self.rng.gauss(0.0, sigma) - sigma * sigma / 2)
        if self.s.churn > 0 and not isl.death_pending and self.rng.random() < self.s.churn:
            isl.death_pending = True
            self.loop.at(self.loop.now + self.rng.random() * (isl.last_round_s or work), self.die, isl, isl.life)
        self.cpu.run(isl, work, self.computed, isl)

    def computed(self, isl: Island) -> None:
        isl.compute_end = self.loop.now
        if self.scheme == "roster":
            self.read_registry(isl)
        elif self.scheme == "flat":
            self.join(isl, isl.round, 0)
        else:
            self.gossip_ready(isl)

    def end_round(self, isl: Island, r: int, committed: bool, donors: Sequence[int] = ()) -> None:
        """Island ``isl`` is done with round ``r``; the islands waiting for its end catch up from ``donors`` (the
        members of the roster that committed, one at random each), then everyone starts round ``r + 1``."""
        now = self.loop.now
        isl.last_round_s = now - isl.round_start
        self.durations.append(isl.last_round_s)
        self.idle.append(now - isl.compute_end)
        self.round_end[r] = max(self.round_end[r], now)
        if r == self.s.rounds - 1:
            self.finished.add(isl.id)
        for j, life, restarted in self.waiting_for_round.pop(r, []):
            late = self.islands[j]
            if late.life != life or not self.reachable(late, isl):
                continue
            late.view = isl.view
            if (committed or restarted) and donors:
                self.catch_up(late, life, self.islands[self.rng.choice(donors)], r + 1)
            else:
                self.catch_up(late, life, None, r + 1)
        if committed:
            self.cpu.run(isl, self.s.round_overhead_s, self.start_round, isl, r + 1)
        else:
            self.start_round(isl, r + 1)

    # -- the registry and the joins (roster, flat)
    def registry_bytes(self) -> float:
        return len(self.registry) * self.s.record_bytes * self.s.dht_replicas

    def read_registry(self, isl: Island) -> None:
        """One DHT get of the run's registrations, from ``dht_replicas`` nodes."""
        size = self.registry_bytes()
        t = max(self.loop.now + self.s.registry_rtts * self.typical_rtt(isl), isl.down_free) + size / isl.rate
        isl.down_free = t
        self.count(isl, size, sent=False, payload=False)
        work = self.s.cpu_per_message_s * self.s.dht_replicas + self.s.cpu_per_byte_s * size
        self.later(isl, t, self.cpu.run, isl, work, self.join, isl, isl.round, 0)

    def is_gone(self, isl: Island, j: int) -> bool:
        return isl.gone.get(j) == self.islands[j].life

    def leader_of(self, isl: Island, r: int) -> Island:
        """The first island of round ``r``'s order over its last committed roster that it does not know gone."""
        assert isl.view is not None
        for j in isl.view.order(r):
            if not self.is_gone(isl, j):
                return self.islands[j]
        return isl

    def join(self, isl: Island, r: int, a: int, expected: set[int] | None = None) -> None:
        """Send a join for attempt ``a`` of round ``r`` to the leader this island picks (``expected``: a retry's
        roster).  With hivemind's matchmaking (flat), the join reaches the group after its measured round trips."""
        leader = self.leader_of(isl, r)
        t = self.send_small(isl, leader, self.s.join_bytes)
        if self.scheme == "flat":
            t = max(t, self.loop.now + (self.s.hivemind_rtts - 0.5) * self.typical_rtt(isl))
        if not self.reachable(isl, leader):
            self.later(isl, self.loop.now + self.s.silent_timeout, self.bounced, isl, leader, leader.life, r, a,
                       expected)
            return
        self.loop.at(t, self.join_arrives, isl, isl.life, isl.epoch, leader, r, a, expected)

    def bounced(self, isl: Island, leader: Island, life: int, r: int, a: int, expected: set[int] | None) -> None:
        """The leader did not answer: mark it gone and join the next one."""
        isl.gone[leader.id] = life
        self.join(isl, r, a, expected)

    def join_arrives(self, isl: Island, life: int, epoch: int, leader: Island, r: int, a: int,
                     expected: set[int] | None) -> None:
        if isl.life != life or isl.epoch != epoch:
            return
        if not leader.alive:
            self.later(isl, self.loop.now + self.detect_seconds(leader), self.bounced, isl, leader, leader.life, r,
                       a, expected)
            return
        key = (r, a, leader.id)
        g = self.gatherings.get(key)
        if g is None or g.leader_life != leader.life:
            assert leader.view is not None
            g = self.gatherings[key] = Gathering(r, a, leader.id, leader.life, leader.view, expected)
            self.open(g, leader)
        if g.closed:  # too late for this round: wait for its end, then catch up
            self.late += 1
            isl.epoch += 1
            self.wait_for_end(isl, r, restarted=False)
            return
        isl.attempt = g
        g.joined[isl.id] = self.loop.now
        if g.expected is not None and isl.id in g.expected:
            g.missing -= 1
        if isl.id in g.view.members:
            g.in_view += 1
        self.check(g)

    def open(self, g: Gathering, leader: Island) -> None:
        """A leader's first join of an attempt: learn whom to wait for, and arm its timers."""
        now = self.loop.now
        if g.attempt > 0:
            self.set_expected(g, {j for j in g.retry_expected or () if not self.is_gone(leader, j)})
        elif self.scheme == "roster":
            size = self.registry_bytes()
            self.count(leader, size, sent=False, payload=False)
            t = now + self.s.registry_rtts * self.typical_rtt(leader) + size / leader.rate
            self.loop.at(t, self.leader_read_registry, g, leader)
        else:  # flat: the islands of the last roster it does not know gone
            self.set_expected(g, {j for j in g.view.roster if not self.is_gone(leader, j)})
        self.loop.at(now + self.s.round_timeout, self.close, g)

    def leader_read_registry(self, g: Gathering, leader: Island) -> None:
        """Whom the leader waits for in a first attempt: the islands the registry lists as live (a heartbeat
        within two periods) and heading for this round or an earlier one, less those it knows gone."""
        if leader.life == g.leader_life:
            now, islands = self.loop.now, self.islands
            self.set_expected(g, {j for j in self.registry if islands[j].stale_at > now
                                  and islands[j].reg_step <= g.round and not self.is_gone(leader, j)})

    def set_expected(self, g: Gathering, expected: set[int]) -> None:
        g.expected = expected
        g.missing = len(expected - g.joined.keys())
        self.check(g)

    def check(self, g: Gathering) -> None:
        if g.closed:
            return
        if g.expected is not None and g.missing <= 0:
            self.close(g)
        elif not g.timer and g.in_view >= g.view.majority:
            g.timer = True
            self.loop.at(self.loop.now + self.s.matchmaking_time, self.close, g)

    def close(self, g: Gathering) -> None:
        """The leader closes the roster and sends it to every member (roster: the ids of all and the metadata
        of the member's group; flat: every member's metadata)."""
        leader = self.islands[g.leader]
        if g.closed or not leader.alive or leader.life != g.leader_life or not g.joined:
            return
        g.closed = True
        roster = tuple(sorted(g.joined))
        # today's protocol (flat) commits whatever group formed; the roster rounds need a majority of the last roster
        quorum = self.scheme != "roster" or len(g.view.members.intersection(roster)) >= g.view.majority
        attempt = Attempt(g.round, g.attempt, leader.id, roster, quorum, self.loop.now)
        self.led[leader.id] = attempt
        for i in roster:
            self.islands[i].attempt = attempt
        if self.scheme == "roster":
            attempt.groups = split(roster, self.s.group_size)
            size = self.s.id_bytes * len(roster) + self.s.join_bytes * max(len(x) for x in attempt.groups)
        else:
            attempt.groups = [list(roster)]
            size = self.s.join_bytes * len(roster)
        self.plan(attempt, attempt.groups)
        fanout = Collective(self, [leader.id], roster, size, payload=False, server=True)
        self.cpu.run(leader, self.s.cpu_per_message_s * len(roster), fanout.send, leader.id, lambda: None,
                     server=True)  # the joins it took in
        for i in roster:
            member = self.islands[i]
            if member.alive:
                fanout.receive(i, self.step, member, attempt, 0)
            else:
                self.fail_later(attempt, member)

    def plan(self, attempt: Attempt, groups: list[list[int]]) -> None:
        """Each member's steps: the exchange (two-level over several groups, flat in one), then the vote."""
        c, roster = self.s.payload, attempt.roster
        steps: dict[int, list[tuple[str, Collective]]] = {i: [] for i in roster}
        if len(groups) == 1:
            if self.s.exchange == "gather":
                phases = [Collective(self, roster, roster, c, payload=True)]
            else:  # reduce-scatter, then all-gather
                phases = [Collective(self, roster, roster, c / len(roster), payload=True) for _ in range(2)]
            for coll in phases:
                for i in roster:
                    steps[i] += [("send", coll), ("recv", coll)]
        else:
            p, k = min(len(x) for x in groups), len(groups)
            owners = [x[:p] for x in groups]
            across = []  # per part: its k owners' reduce-scatter and all-gather
            for part in range(p):
                peers = [own[part] for own in owners]
                across.append([Collective(self, peers, peers, c / (p * k), payload=True) for _ in range(2)])
            for members, own in zip(groups, owners):
                level1 = Collective(self, members, own, c / p, payload=True)
                level3 = Collective(self, own, members, c / p, payload=True)
                for i in members:
                    steps[i].append(("send", level1))
                for part, i in enumerate(own):
                    rs, ag = across[part]
                    steps[i] += [("recv", level1), ("send", rs), ("recv", rs), ("send", ag), ("recv", ag),
                                 ("send", level3)]
                for i in members:
                    steps[i].append(("recv", level3))
        attempt.vote = Collective(self, roster, roster, self.s.verdict_bytes, payload=False)
        for i in roster:
            steps[i] += [("send", attempt.vote), ("recv", attempt.vote)]
        attempt.steps = steps

    def step(self, isl: Island, attempt: Attempt, k: int) -> None:
        if attempt.failed or isl.attempt is not attempt:
            return
        steps = attempt.steps[isl.id]
        if k == len(steps):
            self.finish(isl, attempt)
            return
        kind, coll = steps[k]
        if kind == "recv":
            coll.receive(isl.id, self.step, isl, attempt, k + 1)
        elif coll is attempt.vote:
            coll.send(isl.id, lambda: (attempt.verdicts.add(isl.id), self.step(isl, attempt, k + 1)))
        else:
            coll.send(isl.id, lambda: self.step(isl, attempt, k + 1))

    def finish(self, isl: Island, attempt: Attempt) -> None:
        """Every verdict is in: the round commits if the roster holds a majority of the last committed one."""
        attempt.finished.add(isl.id)
        self.exchange.append(self.loop.now - attempt.closed_at)
        r = attempt.round
        if attempt.quorum:
            if len(attempt.finished) == 1:
                self.commits[r] += 1
                attempt.view = View(attempt.roster)
                if self.latest is None or self.latest[0] < r:
                    self.latest = (r, attempt.view)
            isl.view = attempt.view
            self.commit_end[r] = max(self.commit_end[r], self.loop.now)
        elif self.behind(isl):  # its roster missed the quorum while the run went on: catch up
            self.late += 1
            isl.epoch += 1
            self.wait_for_end(isl, self.latest[0] + 1, restarted=False)  # type: ignore[index]
            return
        self.end_round(isl, r, attempt.quorum, attempt.roster)

    def behind(self, isl: Island) -> bool:
        """Whether a later roster than the one this island knows committed, among islands it can reach."""
        if self.latest is None or self.latest[1] is isl.view:
            return False
        return self.reachable(isl, self.islands[self.latest[1].roster[0]]) and self.latest[0] + 1 < self.s.rounds

    def fail_later(self, attempt: Attempt, dead: Island) -> None:
        """A member (or the leader) died before its verdict: the others learn it ``detect`` seconds after the
        roster closed or it died, whichever is later, and abandon the attempt."""
        t = max(self.loop.now, attempt.closed_at) + self.detect_seconds(dead)
        if t < attempt.fail_at:
            attempt.fail_at = t
            self.loop.at(t, self.fail, attempt)

    def fail(self, attempt: Attempt) -> None:
        if attempt.failed or attempt.finished or self.loop.now < attempt.fail_at:
            return
        attempt.failed = True
        dead = [self.islands[j] for j in attempt.roster if not self.islands[j].alive]
        survivors = [self.islands[j] for j in attempt.roster
                     if self.islands[j].alive and self.islands[j].attempt is attempt]
        retry = attempt.index < self.s.retries
        if retry and survivors:
            self.retries += 1
        expected = set(attempt.roster) - {d.id for d in dead}
        for isl in survivors:
            isl.epoch += 1
            for d in dead:
                isl.gone[d.id] = d.life
            if retry:
                self.join(isl, attempt.round, attempt.index + 1, expected)
            else:
                self.end_round(isl, attempt.round, False, [x.id for x in survivors])

    # -- churn
    def die(self, isl: Island, life: int) -> None:
        if isl.life != life or not isl.alive:
            return
        self.deaths += 1
        isl.alive, isl.death_pending = False, False
        isl.life += 1
        isl.epoch += 1
        isl.silent = self.rng.random() < self.s.silent_fraction
        isl.stale_at = self.loop.now + self.s.heartbeat_s * (2 - self.rng.random())
        self.cpu.cancel(isl)
        self.loop.at(self.loop.now + self.s.record_ttl, self.expire, isl, isl.life)
        for a in (isl.attempt, self.led.get(isl.id)):
            if isinstance(a, Attempt) and not a.failed and not a.finished and isl.id not in a.verdicts:
                self.fail_later(a, isl)
        for g in self.gatherings.values():
            if g.leader == isl.id and not g.closed:
                for j, joined_at in g.joined.items():
                    member = self.islands[j]
                    if member.alive and member.attempt is g:
                        self.later(member, max(self.loop.now, joined_at) + self.detect_seconds(isl), self.bounced,
                                   member, isl, isl.life, g.round, g.attempt, g.retry_expected)
        if self.scheme == "gossip":
            self.gossip_partner_died(isl)
        self.loop.at(self.loop.now + self.s.restart_s, self.restart, isl)

    def expire(self, isl: Island, life: int) -> None:
        if isl.life == life:
            self.registry.discard(isl.id)

    def restart(self, isl: Island) -> None:
        """Running again: a new process (no open connections), registered, catching up."""
        isl.alive, isl.stale_at = True, math.inf
        isl.life += 1
        isl.epoch += 1
        for other in self.islands:
            other.warm.discard(isl.id)
        isl.warm = set()
        isl.up_free = isl.down_free = self.loop.now
        self.registry.add(isl.id)
        isl.reg_step = math.inf
        isl.attempt = None
        if self.scheme == "gossip":
            donors = [x for x in self.islands if x.alive and x is not isl and self.reachable(x, isl)]
            if donors:
                donor = self.rng.choice(donors)
                self.catch_up(isl, isl.life, donor, donor.round)
            return
        self.wait_for_end(isl, 0, restarted=True)

    def wait_for_end(self, isl: Island, r: int, restarted: bool) -> None:
        """Catch up when the first round from ``r`` on that nobody has finished yet ends."""
        while r < self.s.rounds and self.round_end[r] > 0:
            r += 1
        if r < self.s.rounds:
            self.waiting_for_round.setdefault(r, []).append((isl.id, isl.life, restarted))

    def catch_up(self, isl: Island, life: int, donor: Island | None, r: int) -> None:
        """Download θ_global from ``donor`` (none: the island's own is current), then start round ``r``."""
        if not isl.alive or isl.life != life:
            return
        isl.reg_step = r
        isl.round_start = isl.compute_end = self.loop.now
        if donor is None or not donor.alive or not self.reachable(isl, donor):
            self.start_round(isl, r)
            return
        size = self.s.state_factor * self.s.payload
        rate = min(donor.rate, isl.rate)
        start = max(self.loop.now + self.rtt(isl, donor), donor.up_free)
        end = start + size / rate + self.open_seconds(donor, (isl.id,), isl.lat, size, rate) + donor.lat + isl.lat
        donor.up_free = start + size / donor.rate
        self.count(donor, size, sent=True, payload=False)
        self.count(isl, size, sent=False, payload=False)
        self.later(isl, end, self.cpu.run, isl, self.s.cpu_per_byte_s * size, self.start_round, isl, r)

    # -- gossip
    def matching(self, r: int) -> dict[int, int]:
        """Round ``r``'s random pairs among the islands registered for it (within each side of a partition)."""
        if r not in self.matchings:
            pairs: dict[int, int] = {}
            for side in (0, 1):
                live = [i.id for i in self.islands if i.alive and i.side == side and i.reg_step <= r]
                self.rng.shuffle(live)
                for a, b in zip(live[::2], live[1::2]):
                    pairs[a], pairs[b] = b, a
            self.matchings[r] = pairs
        return self.matchings[r]

    def gossip_ready(self, isl: Island) -> None:
        """Average with this round's partner once it is ready too (alone if it has none, is gone or moved on)."""
        r = isl.round
        self.gossip_rounds += 1
        peer_id = self.matching(r).get(isl.id)
        if peer_id is None:
            self.end_round(isl, r, False)
            return
        peer = self.islands[peer_id]
        if not peer.alive:
            self.later(isl, self.loop.now + self.detect_seconds(peer), self.end_round, isl, r, False)
        elif peer.round > r:
            self.end_round(isl, r, False)
        elif (r, peer_id) in self.ready:
            self.ready.discard((r, peer_id))
            self.gossip_exchange(isl, peer, r)
        else:
            self.ready.add((r, isl.id))

    def release_partners(self, isl: Island, skipped: Iterable[int]) -> None:
        """Partners waiting for ``isl`` in rounds it skips (it restarted and caught up) average alone."""
        for q in skipped:
            j = self.matchings.get(q, {}).get(isl.id)
            if j is not None and (q, j) in self.ready:
                self.ready.discard((q, j))
                self.end_round(self.islands[j], q, False)

    def gossip_exchange(self, a: Island, b: Island, r: int) -> None:
        """A request and its answer (a round trip), then each sends its payload to the other."""
        pair = Collective(self, [a.id, b.id], [a.id, b.id], self.s.payload, payload=True)
        t = self.loop.now + self.rtt(a, b)
        for x in (a, b):
            x.attempt = pair
            self.later(x, t, pair.send, x.id, lambda: None)
            pair.receive(x.id, self.gossip_done, x, pair, r, self.loop.now)

    def gossip_done(self, isl: Island, pair: Collective, r: int, paired_at: float) -> None:
        if isl.attempt is pair:
            self.averaged += 1
            self.exchange.append(self.loop.now - paired_at)
            self.end_round(isl, r, True, [i for i in pair.senders if i != isl.id])

    def gossip_partner_died(self, dead: Island) -> None:
        """Whoever waits for or exchanges with ``dead`` finds it gone and ends its round alone."""
        for r in list(self.matchings):
            self.ready.discard((r, dead.id))
        for peer in self.islands:
            if not peer.alive or peer.round not in self.matchings:
                continue
            r = peer.round
            if self.matchings[r].get(peer.id) != dead.id:
                continue
            exchanging = isinstance(peer.attempt, Collective) and dead.id in peer.attempt.sender_set
            if (r, peer.id) in self.ready or exchanging:
                self.ready.discard((r, peer.id))
                peer.epoch += 1
                peer.attempt = None
                self.later(peer, self.loop.now + self.detect_seconds(dead), self.end_round, peer, r, False)


def split(roster: Sequence[int], group_size: int) -> list[list[int]]:
    """The roster in ceil(n / G) groups of near-equal size, in roster order (the same split on every member)."""
    n = len(roster)
    k = max(1, math.ceil(n / group_size))
    base, extra = divmod(n, k)
    groups, at = [], 0
    for g in range(k):
        size = base + (g < extra)
        groups.append(list(roster[at:at + size]))
        at += size
    return groups


def gossip_spread(n: int, threshold: float, seed: int, max_rounds: int = 1000) -> tuple[float, float]:
    """The linear averaging model of gossip: every island holds a value, each round random pairs replace theirs
    by their mean.  Returns the rounds until the spread (standard deviation across islands) falls below
    ``threshold`` × its start, and the steady spread when every island also drifts by independent noise of
    standard deviation 1 every round (an all-reduce that commits ends every round at 0)."""
    rng = random.Random(f"{seed}:{n}:spread")

    def average(x: list[float]) -> None:
        order = list(range(n))
        rng.shuffle(order)
        for a, b in zip(order[::2], order[1::2]):
            x[a] = x[b] = (x[a] + x[b]) / 2

    x = [rng.gauss(0.0, 1.0) for _ in range(n)]
    start = statistics.pstdev(x)
    rounds = float("nan")
    for r in range(1, max_rounds + 1):
        average(x)
        if statistics.pstdev(x) < threshold * start:
            rounds = float(r)
            break
    y = [0.0] * n
    spreads = []
    for r in range(60):
        y = [v + rng.gauss(0.0, 1.0) for v in y]
        average(y)
        if r >= 20:
            spreads.append(statistics.pstdev(y))
    return rounds, statistics.fmean(spreads)


def simulate(s: Settings, n: int, scheme: str) -> RunResult:
    """Simulate ``s.rounds`` rounds of ``n`` islands under ``scheme``."""
    return Sim(s, n, scheme).run()


# ---- the report ---------------------------------------------------------------------------------------------

HEADERS = ["islands", "scheme", "round s (median)", "round s (p90)", "outside compute s (median)",
           "exchange + vote s (median)",
           "sent / island / round", "received / island / round", "payload sent / island / round", "committed",
           "s per commit", "retries", "deaths", "late"]


def row(r: RunResult) -> list[Any]:
    if r.scheme == "gossip":
        committed = f"{r.averaged_fraction:.0%} averaged"
    else:
        committed = f"{r.committed}/{r.rounds}"
        if r.max_commits_per_round > 1:
            committed += f" (split: {r.max_commits_per_round} rosters in one round)"
    return [r.islands, r.scheme, f"{r.median_round:.2f}", f"{r.p90_round:.2f}", f"{r.median_idle:.2f}",
            f"{r.median_exchange:.2f}",
            format_bytes(r.per_island_round(r.sent_bytes)), format_bytes(r.per_island_round(r.received_bytes)),
            format_bytes(r.per_island_round(r.payload_sent_bytes)), committed,
            "–" if r.scheme == "gossip" else f"{r.seconds_per_commit:.1f}", r.retries, r.deaths, r.late]


def bounds(s: Settings) -> list[str]:
    """The reference figures a round cannot beat, in words."""
    rates = per_island("rate", s.rate, 1, random.Random(0), parse_rate)
    rtts = per_island("rtt_ms", s.rtt_ms, 1, random.Random(0), float)
    steps = per_island("step_s", s.step_s, 1, random.Random(0), float)
    c, rate, rtt = s.payload, rates[0] / 8, rtts[0] / 1e3
    return [
        f"payload c = {format_bytes(c)} per island; c ÷ rate = {c / rate:.3g} s; a bandwidth-optimal all-reduce "
        f"sends 2c(n-1)/n, {2 * c / rate:.3g} s",
        f"compute per round: H × step = {s.inner_steps} × {steps[0]:g} s = {s.inner_steps * steps[0]:.1f} s "
        f"(first island's figures)",
        f"latency per round, roster: registry {s.registry_rtts:g} RTT + join 0.5 + roster 0.5 + 4 one-way phases "
        f"(2 with one group) + vote 0.5 = {(s.registry_rtts + 3.5) * rtt:.3g} s at {rtt * 1e3:g} ms; flat: "
        f"{s.hivemind_rtts:g} + 1 + 0.5 RTT = {(s.hivemind_rtts + 1.5) * rtt:.3g} s; gossip: 1.5 RTT = "
        f"{1.5 * rtt:.3g} s",
    ]


def summary(r: RunResult) -> dict[str, Any]:
    """``r`` for results.json: its counts and the round times, the per-island lists as their quantiles."""
    lists = ("idle_seconds", "exchange_seconds") + (("round_seconds",) if r.scheme == "gossip" else ())
    out = {k: v for k, v in dataclasses.asdict(r).items() if k not in lists}
    for name in ("round_seconds", "idle_seconds", "exchange_seconds"):
        values = getattr(r, name)
        out[name.replace("_seconds", "") + "_quantiles"] = {q: quantile(values, q) for q in (0.1, 0.5, 0.9)}
    out["seconds_per_commit"] = r.seconds_per_commit
    for name in ("sent_bytes", "received_bytes", "payload_sent_bytes"):
        out[name + "_per_island_round"] = r.per_island_round(getattr(r, name))
    return out


def markdown(results: Sequence[RunResult], s: Settings, command: str) -> str:
    lines = [f"# Scale simulation: {', '.join(map(str, s.islands))} islands", "", f"`{command}`", "",
             markdown_table(HEADERS, [row(r) for r in results]), ""]
    lines += [f"- {b}" for b in bounds(s)]
    for r in results:
        if r.scheme == "gossip":
            lines.append(f"- gossip, {r.islands} islands: the spread of θ falls below {s.spread_threshold:g} of its "
                         f"start after {r.spread_rounds:g} rounds of pairwise averaging; with independent drift "
                         f"every round it settles at {r.steady_spread:.2f} × one round's drift (0 after an "
                         f"all-reduce that commits)")
    lines += ["", "Settings:", "", "```json", json.dumps(dataclasses.asdict(s), indent=1), "```", ""]
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, share) = plt.subplots(1, 3, figsize=(13, 3.8))
    schemes = [sc for sc in SCHEMES if any(r.scheme == sc for r in results)]
    sizes = sorted({r.islands for r in results})
    width = 0.8 / max(len(schemes), 1)
    for k, scheme in enumerate(schemes):
        mine = {r.islands: r for r in results if r.scheme == scheme}
        xs = [i + (k - (len(schemes) - 1) / 2) * width for i, n in enumerate(sizes) if n in mine]
        got = [mine[n] for n in sizes if n in mine]
        med = [r.median_round for r in got]
        p90 = [max(r.p90_round - r.median_round, 0) for r in got]
        left.bar(xs, med, width, yerr=[[0] * len(got), p90], capsize=3, label=scheme)
        right.bar(xs, [r.per_island_round(r.sent_bytes) / 1e6 for r in got], width, label=scheme)
        share.bar(xs, [100 * (r.averaged_fraction if r.scheme == "gossip" else r.committed / r.rounds) for r in got],
                  width, label=scheme)
    for ax, label in ((left, "round time (s): median, bar to p90"), (right, "MB sent per island per round"),
                      (share, "% rounds committed (gossip: averaged)")):
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"{n} islands" for n in sizes])
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("roster rounds vs flat all-reduce vs gossip (simulated)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command line ---------------------------------------------------------------------------------------

def _kind(f: dataclasses.Field) -> Callable[[str], Any]:
    if f.type in ("bool", bool):
        return lambda text: {"true": True, "false": False, "1": True, "0": False}[text.lower()]
    if f.type in ("int", int):
        return int
    if f.type in ("float", float):
        return float
    if f.name == "islands":
        return lambda text: [int(x) for x in text.split(",") if x.strip()]
    if f.name == "schemes":
        return lambda text: [x.strip() for x in text.split(",") if x.strip()]
    return str


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco experiment scale-sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        default = getattr(defaults, f.name)
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
                       help=f"{f.metadata['help']} (default {shown})")
    p.add_argument("--calibrate", type=Path, help="a JSON file of measured figures: any of the keys above, "
                   "with underscores (experiments/scale_sim.md lists them)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    return p


_WORDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "list[int]": "a list such as 100,1000"}


def settings_from(given: dict[str, str], calibration: dict[str, Any] | None) -> Settings:
    """Defaults, then the calibration file's figures, then the flags given."""
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name, value in (calibration or {}).items():
        if name not in fields:
            raise ScaleSimError(f"the calibration file has unknown key {name!r}: use the names --help lists, "
                                f"with underscores")
        values[name] = _from_json(fields[name], value)
    for name, text in given.items():
        try:
            values[name] = _kind(fields[name])(text)
        except (KeyError, ValueError):
            wanted = _WORDS.get(str(fields[name].type), "valid")
            raise ScaleSimError(f"--{name.replace('_', '-')} {text!r} is not {wanted}") from None
    s = Settings(**values)
    s.check()
    return s


def _from_json(f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    ok = {"bool": isinstance(value, bool), "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool)}.get(kind)
    if ok is None:
        if f.name in ("islands", "schemes"):
            items = value if isinstance(value, list) else str(value).split(",")
            return [int(x) if f.name == "islands" else str(x).strip() for x in items]
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return str(value)
        ok = False
    if not ok:
        raise ScaleSimError(f"the calibration file's {f.name!r} is {value!r}, not {_WORDS.get(kind, kind)}")
    return float(value) if kind == "float" else value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k not in ("calibrate", "out")}
    try:
        calibration = None
        if args.calibrate is not None:
            try:
                calibration = json.loads(args.calibrate.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ScaleSimError(f"--calibrate {args.calibrate}: cannot read it as JSON ({e})") from None
            if not isinstance(calibration, dict):
                raise ScaleSimError(f"--calibrate {args.calibrate} must hold one JSON object of figures")
        s = settings_from(given, calibration)
    except (ScaleSimError, ValueError) as e:
        # the simulator runs without torch, so it reports its own errors (diloco.command pulls torch in)
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = []
    for n in s.islands:
        for scheme in s.schemes:
            r = simulate(s, n, scheme)
            results.append(r)
            print(f"{n} islands, {scheme}: simulated in {r.sim_seconds:.1f} s", flush=True)
    command = "python -m experiments.scale_sim " + " ".join(argv)
    print(markdown_table(HEADERS, [row(r) for r in results]))
    for b in bounds(s):
        print(f"  {b}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(markdown(results, s, command.strip()))
    (args.out / "results.json").write_text(json.dumps(
        {"command": command.strip(), "settings": dataclasses.asdict(s),
         "results": [summary(r) for r in results]}, indent=1, default=str))
    plot(results, args.out / "scale_sim.png")
    print(f"wrote {args.out}/results.md, results.json, scale_sim.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
