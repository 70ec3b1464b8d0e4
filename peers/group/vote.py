"""The vote that ends every averaging round, with verdicts sent straight to the other group members.

Each member's verdict (the fingerprint of the result it received) goes to every other member as one
message over the direct transport that has just carried the round's parts (:mod:`peers.wire.transport`: its
connections are open, and it reaches islands behind NAT through lanes and relays), else as one request over
hivemind's p2p daemon; a member waiting for verdicts wakes the moment one arrives: no polling on the happy path.
Through the daemon, 24 islands on one 2-core machine lost most rounds' votes (23 of 24 did not confirm): the
daemons' calls queue behind the DHT's traffic, and each vote that outlived ``GRACE`` turned to polling the DHT,
adding to it.  The DHT record of the polled vote stays as the fallback: a member
publishes its verdict under the round's vote key when a direct send fails (a peer it cannot reach,
or one running without this channel) or when the vote is still undecided after ``GRACE`` seconds,
and from then on polls that key, feeding what it finds into the same inbox.

A verdict counts only when its sender (authenticated by libp2p, or the DHT subkey, signed with the
run key in a private run) is a member of the group; in a private run the direct channel refuses
senders that are not registered in the run's member registry at all.

Islands behind NAT cannot reach each other through the daemon: they also publish their verdicts in the DHT record
at once, and never take a member they cannot reach for gone.

The host process talks to the daemon through :mod:`peers.wire.p2p_loop`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
from hivemind.p2p import P2PContext, PeerID

from peers.discovery.membership import MemberCheck
from peers.discovery.owned import dht_identity, owned_items, owned_value
from peers.wire.encoded import DirectChannel
from peers.wire.inbox import GONE, Inbox, LateAnswers
from peers.wire.p2p_loop import Handler, _submit, message_class, spawn
from peers.wire.transport import TransportError

log = logging.getLogger(__name__)

GRACE = 1.5
"""Seconds a vote waits for direct verdicts before it also publishes and polls the DHT record (at once when a send
failed)."""
POLL = 0.5
"""Seconds between two reads of the DHT record once polling started (the polled-only vote: ``POLL_ONLY``).  A read
fetches every member's verdict from each DHT node it visits."""
POLL_ONLY = 0.1
SEND_TIMEOUT = 5.0
"""Longest wait for one member to acknowledge our verdict before we publish it in the DHT instead."""
GONE_AFTER = 1.0
"""Seconds a member we could not reach at all gets to show its verdict in the DHT record before the vote
stops waiting for it: a SIGKILLed island's daemon is gone, and its connections fail at once."""
MAX_FINGERPRINT = 4096


Verdict = message_class("Verdict", [("key", "string"), ("fingerprint", "double", "repeated"),
                                     ("accepted", "bool"), ("group", "string", "repeated")])
"""Protobuf message of one verdict: the vote key, the fingerprint, the group's members (so that a member
whose matchmaking missed the group learns all of it), and in the reply whether it was taken."""


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

    def verdict(self, group_size: int, majority: bool = False) -> tuple[str, int, int]:
        """('' if the round stands, else why not; how many members voted; how many are left when only missing
        verdicts are wrong: the voters and the members alive without a result, else 0).  ``majority``: the round
        stands when the members agreeing with us are more than half the group, whatever the others say (every
        member computed the result itself from the same bytes: one that votes otherwise is wrong, and
        :attr:`differ` names it)."""
        if majority and self.differ and 2 * (len(self.votes) - len(self.differ)) > group_size:
            return "", len(self.votes), 0
        if not all(math.isfinite(x) for v in self.votes.values() for x in v):
            return "the averaged pseudo-gradient is not finite (a peer sent NaN or Inf)", 0, 0
        voters = len(self.votes)
        if self.differ:
            return "islands received different averages (an all-reduce part failed); discarding the round", voters, 0
        if self.missing:
            return (f"{len(self.missing)} of {group_size} island(s) did not confirm the result (left or failed "
                    f"mid-round)", voters, voters + len(self.abstained))
        return "", voters, 0


def _decided(t: Tally, majority: bool = False) -> bool:
    """Whether the vote can end: every verdict is in (or known not to come), or, unless the majority decides, one
    differs from ours."""
    return len(t.missing) == len(t.unreachable) + len(t.abstained) or (bool(t.differ) and not majority)


class VoteChannel:
    """Holds this peer's votes for one averager ``prefix``: sends verdicts to the group members, takes
    theirs, and falls back to the DHT record.  ``members``: in a private run, who may send a verdict
    directly; ``direct=False`` gives the polled DHT vote only (kept for benchmarks and tests);
    ``reachable=False`` (an island behind NAT): also publish every verdict in the DHT at once, since the
    members that cannot be reached either will never get it directly, and never take a member it cannot
    reach for gone."""

    def __init__(self, dht: hivemind.DHT, prefix: str, members: MemberCheck | None = None, direct: bool = True,
                 ttl: float = 120.0, reachable: bool = True):
        self.dht, self.members, self.direct, self.reachable = dht, members, direct, reachable
        self.name = f"{prefix}::diloco.verdict"
        self.box = Inbox(ttl)
        self._sends: set[asyncio.Future] = set()
        self._abstained = LateAnswers()
        """Votes we abstained on: a verdict that comes later gets our abstention back at once."""
        self._handler = Handler(dht, self.name, self._on_verdict, Verdict) if direct else None
        self._lanes: DirectChannel | None = None

    def use_lanes(self, channel: DirectChannel) -> None:
        """Send and take verdicts over the direct transport of ``channel`` first (the daemon's calls and the DHT
        record stay the fallback)."""
        self._lanes = channel
        channel.transport.handlers[self.name + "/"] = self._on_lane_verdict

    def _on_lane_verdict(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        try:
            body = json.loads(bytes(payload))
            fingerprint, group = [float(x) for x in body["fingerprint"]], [str(p) for p in body["group"]]
        except (ValueError, KeyError, TypeError):
            return True
        if len(fingerprint) <= MAX_FINGERPRINT and self._member(sender):
            self._take(key.removeprefix(self.name + "/"), sender, fingerprint, group)
        return True

    def _member(self, sender: str) -> bool:
        """Whether ``sender``'s verdict may count, when it came over the transport: in a private run, a transport that
        holds the run key took it from a holder only (its handshake proves the key); one without the key asks the
        member registry, as for a verdict through the daemon (a DHT read, seconds on a loaded machine)."""
        if not self.members or (self._lanes is not None and self._lanes.transport.key):
            return True
        asked = _submit(self.members.allows(sender))
        try:
            return bool(asked.result(SEND_TIMEOUT))
        except Exception as e:  # the DHT cannot tell now: the verdict can still come through its record
            asked.cancel()  # not left pending on the loop (a run of 32 islands logged such tasks destroyed)
            log.debug("could not check that %s is a member: %s", sender, e)
            return False

    async def _on_verdict(self, request: Any, context: P2PContext) -> Any:
        sender = str(context.remote_id)
        if len(request.fingerprint) > MAX_FINGERPRINT or (self.members and not await self.members.allows(sender)):
            return Verdict(accepted=False)
        self._take(request.key, sender, list(request.fingerprint), list(request.group))
        return Verdict(accepted=True)

    def _take(self, key: str, sender: str, fingerprint: list[float], group: list[str]) -> None:
        """Keep a member's verdict; answer with our abstention if we abstained on that vote before it came."""
        self.box.put(key, sender, fingerprint, group)
        owed = self._abstained.newcomer(key, sender)
        if owed is not None:
            abstention, me, expiration = owed
            _submit(self._later(sender, abstention, me, expiration))

    async def _later(self, sender: str, abstention: Any, me: str, expiration: float) -> None:
        self._send_later(sender, abstention, me, expiration, SEND_TIMEOUT)

    def hold(self, key: str, me: str, peers: Sequence[str], mine: list[float],
             agree: Callable[[list[float], list[float]], bool], timeout: float, expiration: float,
             majority: bool = False) -> Tally:
        """Vote ``mine`` on ``key`` among ``peers`` (``me`` included) for at most ``timeout`` seconds: ends as
        soon as every member's verdict is in or one disagrees with ours.  ``expiration``: DHT time the
        fallback record expires at; ``majority``: wait for every verdict even once one differs (see
        :meth:`Tally.verdict`).  A member that cannot be reached and whose verdict is not in the DHT
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
            return tally(self.box.wait_for(key, lambda received: _decided(tally(received), majority), deadline))
        finally:
            fallback.cancel()  # stops the polling; sends in flight finish on their own
            self.box.release(key)

    async def _fallback(self, verdict: Any, me: str, others: list[str], expiration: float, deadline: float) -> None:
        key, mine, period = verdict.key, list(verdict.fingerprint), POLL_ONLY
        if self.direct:
            period, failed = POLL, asyncio.Event()
            if not self.reachable and mine:  # not cancelled with the vote: an island may end right after it
                spawn(self._store(key, me, mine, expiration), self._sends)
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
        if await self._send_over_lane(peer, verdict, timeout):
            return
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
        # a member that took part in the round and cannot be reached now most likely died; but from behind a NAT,
        # the members behind NATs cannot be reached either: their verdicts come through the DHT record
        if not reached and self.reachable:
            await asyncio.sleep(GONE_AFTER)
            await self._poll(key, me, mine, expiration)
            self.box.put(key, peer, GONE)

    async def _send_over_lane(self, peer: str, verdict: Any, timeout: float) -> bool:
        """Our verdict to ``peer`` over the direct transport; whether it was delivered."""
        lanes = self._lanes
        endpoint = lanes.endpoints.get(peer) if lanes is not None else None
        if endpoint is None:
            return False
        body = json.dumps({"fingerprint": list(verdict.fingerprint), "group": list(verdict.group)}).encode()
        try:
            await asyncio.to_thread(lanes.transport.send, endpoint, f"{self.name}/{verdict.key}", body,
                                    time.monotonic() + max(0.1, timeout))
            return True
        except TransportError as e:
            log.debug("could not send our verdict to %s over the transport: %s", peer, e)
            return False

    def store_as(self, key: str, member: str, fingerprint: list[float], expiration: float) -> None:
        """Fault injection (``forge@vote``): publish ``fingerprint`` in the vote's DHT record as ``member``'s verdict,
        signed with this peer's own key (as an attacker would try; the DHT's nodes refuse it)."""
        _submit(self._store(key, member, fingerprint, expiration))

    async def _store(self, key: str, me: str, mine: list[float], expiration: float) -> bool:
        try:
            signed = owned_value(dht_identity(self.dht), key, mine, expiration)
            return bool(await asyncio.wait_for(self.dht.store(key, subkey=me, value=signed, expiration_time=expiration,
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
        items = owned_items(found, key)  # a verdict counts as its signer's only: none in another member's name
        for subkey, (value, _) in items.items():
            if isinstance(value, (list, tuple)) and len(value) <= MAX_FINGERPRINT:
                self.box.put(key, subkey, list(value))
        if me not in items:
            await self._store(key, me, mine, expiration)
        return True

    def close(self) -> None:
        """Stop taking verdicts (the DHT and its daemon are the caller's)."""
        if self._handler is not None:
            self._handler.close()
