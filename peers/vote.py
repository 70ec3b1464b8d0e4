"""The vote that ends every averaging round, with verdicts sent straight to the other group members.

Each member's verdict (the fingerprint of the result it received) goes to every other member as one
request over hivemind's p2p daemon, and a member waiting for verdicts wakes the moment one arrives:
no polling on the happy path.  The DHT record of the polled vote stays as the fallback: a member
publishes its verdict under the round's vote key when a direct send fails (a peer it cannot reach,
or one running without this channel) or when the vote is still undecided after ``GRACE`` seconds,
and from then on polls that key, feeding what it finds into the same inbox.

A verdict counts only when its sender (authenticated by libp2p, or the DHT subkey, signed with the
run key in a private run) is a member of the group; in a private run the direct channel refuses
senders that are not registered in the run's member registry at all.

The host process talks to the daemon through :mod:`peers.p2p_loop`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
from hivemind.p2p import P2PContext, PeerID

from peers.p2p_loop import Handler, _submit, message_class, spawn
from peers.round_keys import names_group

log = logging.getLogger(__name__)

GRACE = 0.5
"""Seconds a vote waits for direct verdicts before it also publishes and polls the DHT record."""
POLL = 0.2
"""Seconds between two reads of the DHT record once polling started (the polled-only vote: ``POLL_ONLY``)."""
POLL_ONLY = 0.1
SEND_TIMEOUT = 5.0
"""Longest wait for one member to acknowledge our verdict before we publish it in the DHT instead."""
GONE_AFTER = 1.0
"""Seconds a member we could not reach at all gets to show its verdict in the DHT record before the vote
stops waiting for it: a SIGKILLed island's daemon is gone, and its connections fail at once."""
GONE = object()
"""Inbox entry of a member that could not be reached and left no verdict in the DHT record; a verdict
that still arrives replaces it."""
MAX_FINGERPRINT = 4096
MAX_KEYS = 1024
"""Vote keys buffered for votes not yet held here (verdicts can arrive before our all-reduce ends)."""
MAX_GROUP = 1024
"""Most members a message may list as its group (more: the list is ignored)."""
MAX_ANSWERED = 64
"""Keys we stood out of (abstained, declined) whose late messages we still answer."""


Verdict = message_class("Verdict", [("key", "string"), ("fingerprint", "double", "repeated"),
                                     ("accepted", "bool"), ("group", "string", "repeated")])
"""Protobuf message of one verdict: the vote key, the fingerprint, the group's members (so that a member
whose matchmaking missed the group learns all of it), and in the reply whether it was taken."""


def registered(found: Any) -> set[str]:
    """Peer ids holding a live registration in a member-registry DHT lookup result."""
    out: set[str] = set()
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            if isinstance(value, dict) and not value.get("left", False):
                out.add(str(subkey))
    return out


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
        self._known |= registered(await self.dht.get(self.key, latest=True, return_future=True))
        if peer_id not in self._known:
            log.warning("refused a request from %s: not a member of this run", peer_id)
            return False
        return True


class Inbox:
    """Messages received (verdicts, encoded pseudo-gradients), by key and sender; a waiter wakes as soon
    as one arrives."""

    def __init__(self, ttl: float, max_keys: int = MAX_KEYS):
        self.ttl, self.max_keys = ttl, max_keys
        self._changed = threading.Condition()
        self._votes: dict[str, dict[str, Any]] = {}
        self._born: dict[str, float] = {}
        self._groups: dict[str, list[str]] = {}
        self._held: set[str] = set()

    def put(self, key: str, sender: str, value: Any, group: Sequence[str] = ()) -> None:
        """Keep ``sender``'s message on ``key`` (its first one; a real one replaces :data:`GONE`) and wake
        the waiters.  ``group``: the members the message says the key's group has, kept when the key names
        that group and ``sender`` is in it."""
        with self._changed:
            if key not in self._votes:
                self._prune()
                if len(self._votes) >= self.max_keys:
                    return
                self._votes[key], self._born[key] = {}, time.monotonic()
            if self._votes[key].get(sender, GONE) is GONE:
                self._votes[key][sender] = value
            group = sorted(group) if len(group) <= MAX_GROUP else []
            if key not in self._groups and sender in group and names_group(key, group):
                self._groups[key] = group
            self._changed.notify_all()

    def _prune(self) -> None:
        """Forget keys no wait holds that are older than ``ttl``, then the oldest ones beyond ``max_keys``."""
        now, excess = time.monotonic(), len(self._votes) + 1 - self.max_keys  # room for one more key
        for i, (born, k) in enumerate(sorted((t, k) for k, t in self._born.items() if k not in self._held)):
            if i >= excess and now - born <= self.ttl:
                break  # oldest first: the rest is younger
            del self._votes[k], self._born[k]
            self._groups.pop(k, None)

    def wait_for(self, key: str, done: Callable[[dict[str, Any]], bool], deadline: float) -> dict[str, Any]:
        """Block until ``done(messages on key)`` or ``deadline`` (``time.monotonic``); the messages then."""
        with self._changed:
            while True:
                votes = dict(self._votes.get(key, {}))
                left = deadline - time.monotonic()
                if done(votes) or left <= 0:
                    return votes
                self._changed.wait(left)

    def first_since(self, match: Callable[[str], bool], since: float) -> tuple[float, str] | None:
        """(when, as ``time.monotonic``; on which key) the first message arrived on a key ``match`` accepts,
        among keys first seen at or after ``since``; None if none did."""
        with self._changed:
            return min(((t, k) for k, t in self._born.items() if t >= since and match(k)), default=None)

    def senders(self, key: str) -> list[str]:
        """Who sent a message on ``key`` (members we could not reach left out)."""
        with self._changed:
            return sorted(s for s, v in self._votes.get(key, {}).items() if v is not GONE)

    def group(self, key: str, me: str) -> list[str]:
        """The members of ``key``'s group: as its messages listed them, else (none did: DHT-borne verdicts)
        those who sent a message on it, and ``me``."""
        with self._changed:
            return self._groups.get(key) or sorted({*self.senders(key), me})

    def hold(self, key: str) -> None:
        """Keep ``key``'s messages until :meth:`release` (a wait on it is under way)."""
        with self._changed:
            self._held.add(key)

    def release(self, key: str, drop: bool = False) -> None:
        """The wait on ``key`` is over: its messages may age out (``drop``: forget them now)."""
        with self._changed:
            self._held.discard(key)
            if drop and key in self._votes:
                del self._votes[key], self._born[key]
                self._groups.pop(key, None)


class LateAnswers:
    """Keys of rounds we stood out of (abstained on a vote, declined an exchange), whom we told, and what to
    tell the members whose messages on such a key come later: a member we did not know of when we stood out
    must not wait for us either.  Bounded: the oldest key is forgotten first."""

    def __init__(self, max_keys: int = MAX_ANSWERED):
        self.max_keys = max_keys
        self._keys: dict[str, tuple[set[str], Any]] = {}

    def remember(self, key: str, told: Iterable[str], answer: Any) -> None:
        """We stood out of ``key``'s round and told ``told``; ``answer``: what :meth:`newcomer` gives."""
        while len(self._keys) >= self.max_keys:
            del self._keys[next(iter(self._keys))]
        self._keys[key] = (set(told), answer)

    def newcomer(self, key: str, sender: str) -> Any:
        """The answer owed to ``sender``, who just wrote on ``key``, if we stood out of that round without
        telling it (it is told from now on); None otherwise."""
        entry = self._keys.get(key)
        if entry is None or sender in entry[0]:
            return None
        entry[0].add(sender)
        return entry[1]


@dataclass
class Tally:
    """What a vote gathered: ``votes`` holds the group members' verdicts (ours included, unless we abstain)."""

    votes: dict[str, list[float]]
    missing: list[str]
    """Members without a verdict (abstainers and unreachable members included)."""
    differ: list[str]
    """Members whose verdict disagrees with ours (or is not finite)."""
    unreachable: list[str] = field(default_factory=list)
    """Missing members we could not reach, whose verdict was not in the DHT record either."""
    abstained: list[str] = field(default_factory=list)
    """Members alive but without a result (their all-reduce failed), us included when we abstain."""

    def verdict(self, group_size: int) -> tuple[str, int, int]:
        """('' if the round stands, else why not; how many members voted; how many are left when only
        missing verdicts are wrong: the voters and the members alive without a result, else 0)."""
        if not all(math.isfinite(x) for v in self.votes.values() for x in v):
            return "the averaged pseudo-gradient is not finite (a peer sent NaN or Inf)", 0, 0
        voters = len(self.votes)
        if self.differ:
            return "islands received different averages (an all-reduce part failed); discarding the round", voters, 0
        if self.missing:
            return (f"{len(self.missing)} of {group_size} island(s) did not confirm the result (left or failed "
                    f"mid-round)", voters, voters + len(self.abstained))
        return "", voters, 0


def _decided(t: Tally) -> bool:
    return len(t.missing) == len(t.unreachable) + len(t.abstained) or bool(t.differ)


class VoteChannel:
    """Holds this peer's votes for one averager ``prefix``: sends verdicts to the group members, takes
    theirs, and falls back to the DHT record.  ``members``: in a private run, who may send a verdict
    directly; ``direct=False`` gives the polled DHT vote only (kept for benchmarks and tests)."""

    def __init__(self, dht: hivemind.DHT, prefix: str, members: MemberCheck | None = None, direct: bool = True,
                 ttl: float = 120.0):
        self.dht, self.members, self.direct = dht, members, direct
        self.name = f"{prefix}::diloco.verdict"
        self.box = Inbox(ttl)
        self._sends: set[asyncio.Future] = set()
        self._abstained = LateAnswers()
        """Votes we abstained on: a verdict that comes later gets our abstention back at once."""
        self._handler = Handler(dht, self.name, self._on_verdict, Verdict) if direct else None

    async def _on_verdict(self, request: Any, context: P2PContext) -> Any:
        sender = str(context.remote_id)
        if len(request.fingerprint) > MAX_FINGERPRINT or (self.members and not await self.members.allows(sender)):
            return Verdict(accepted=False)
        self.box.put(request.key, sender, list(request.fingerprint), request.group)
        owed = self._abstained.newcomer(request.key, sender)
        if owed is not None:
            abstention, me, expiration = owed
            self._send_later(sender, abstention, me, expiration, SEND_TIMEOUT)
        return Verdict(accepted=True)

    def hold(self, key: str, me: str, peers: Sequence[str], mine: list[float],
             agree: Callable[[list[float], list[float]], bool], timeout: float, expiration: float) -> Tally:
        """Vote ``mine`` on ``key`` among ``peers`` (``me`` included) for at most ``timeout`` seconds: ends as
        soon as every member's verdict is in or one disagrees with ours.  ``expiration``: DHT time the
        fallback record expires at.  A member that cannot be reached and whose verdict is not in the DHT
        record either (``GONE_AFTER``) is not waited for: it counts as missing at once.  ``mine`` empty:
        abstain (we have no result), telling the others not to wait for us, and learn who is left."""
        deadline = time.monotonic() + timeout
        group, verdict = set(peers), Verdict(key=key, fingerprint=mine, group=peers)
        if not mine:  # a group we learned of from its verdicts: members we did not hear from yet are told later
            self._abstained.remember(key, group, (verdict, me, expiration))
        self.box.hold(key)
        fallback = _submit(self._fallback(verdict, me, [p for p in peers if p != me], expiration, deadline))

        def tally(received: dict[str, list[float]]) -> Tally:
            votes = {p: v for p, v in received.items() if p in group and p != me and v is not GONE and len(v)}
            if mine:
                votes[me] = mine
            differ = sorted(p for p, v in votes.items() if mine and not agree(mine, v))
            missing = [p for p in peers if p not in votes]
            return Tally(votes, missing, differ, [p for p in missing if received.get(p) is GONE],
                         [p for p in missing if (p == me and not mine) or (p != me and received.get(p) == [])])

        try:
            return tally(self.box.wait_for(key, lambda received: _decided(tally(received)), deadline))
        finally:
            fallback.cancel()  # stops the polling; sends in flight finish on their own
            self.box.release(key)

    async def _fallback(self, verdict: Any, me: str, others: list[str], expiration: float, deadline: float) -> None:
        key, mine, period = verdict.key, list(verdict.fingerprint), POLL_ONLY
        if self.direct:
            period, failed = POLL, asyncio.Event()
            for p in others:  # not awaited: a member that decided early must still reach the slow ones
                self._send_later(p, verdict, me, expiration, min(SEND_TIMEOUT, deadline - time.monotonic()), failed)
            try:  # a failed send hints that the way back fails too: look in the DHT at once then
                await asyncio.wait_for(failed.wait(), GRACE)
            except asyncio.TimeoutError:
                pass
        else:
            await self._store(key, me, mine, expiration)
        while await self._poll(key, me, mine, expiration):  # until the vote is decided (cancelled) or the DHT gone
            await asyncio.sleep(period)

    def _send_later(self, peer: str, verdict: Any, me: str, expiration: float, timeout: float,
                    failed: asyncio.Event | None = None) -> None:
        """Send our ``verdict`` (a :data:`Verdict`) to ``peer`` without waiting for it (on the p2p loop; sets
        ``failed`` if it fails)."""
        spawn(self._send(peer, verdict, me, failed or asyncio.Event(), expiration, timeout), self._sends)

    async def _send(self, peer: str, verdict: Any, me: str, failed: asyncio.Event, expiration: float,
                    timeout: float) -> None:
        key, mine = verdict.key, list(verdict.fingerprint)
        try:
            reply = await asyncio.wait_for(self._handler.p2p.call_protobuf_handler(
                PeerID.from_base58(peer), self.name, verdict, Verdict), max(0.1, timeout))
            if reply.accepted:
                return
            log.debug("%s refused our verdict; publishing it in the DHT", peer)
            reached = True
        except Exception as e:  # unreachable, no such handler, daemon gone: the DHT record is the way
            log.debug("could not send our verdict to %s (%s); publishing it in the DHT", peer, e)
            reached = False
        failed.set()
        await self._store(key, me, mine, expiration)
        if not reached:  # a member that took part in the round and cannot be reached now most likely died
            await asyncio.sleep(GONE_AFTER)
            await self._poll(key, me, mine, expiration)
            self.box.put(key, peer, GONE)

    async def _store(self, key: str, me: str, mine: list[float], expiration: float) -> bool:
        try:
            return bool(await asyncio.wait_for(self.dht.store(key, subkey=me, value=mine, expiration_time=expiration,
                                                              return_future=True), SEND_TIMEOUT))
        except Exception as e:  # the DHT may be gone; the vote then ends by its timeout
            log.debug("could not publish our verdict in the DHT: %s", e)
            return False

    async def _poll(self, key: str, me: str, mine: list[float], expiration: float) -> bool:
        """Read the DHT record into the box and publish ours if it is not there; False when the DHT is gone."""
        if not self.dht.is_alive():
            return False
        try:
            found = await asyncio.wait_for(self.dht.get(key, latest=True, return_future=True), SEND_TIMEOUT)
        except Exception as e:
            log.debug("could not read the vote record: %s", e)
            found = None
        items = found.value if found is not None and isinstance(found.value, dict) else {}
        for subkey, item in items.items():
            value = getattr(item, "value", None)
            if isinstance(value, (list, tuple)) and len(value) <= MAX_FINGERPRINT:
                self.box.put(key, str(subkey), list(value))
        if me not in {str(s) for s in items}:
            await self._store(key, me, mine, expiration)
        return True

    def close(self) -> None:
        """Stop taking verdicts (the DHT and its daemon are the caller's)."""
        if self._handler is not None:
            self._handler.close()
