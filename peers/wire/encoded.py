"""Encoded pseudo-gradients between the members of a group, over hivemind's p2p daemon.

hivemind's butterfly all-reduce can carry only the codecs in its own table (it decodes a part by the
``CompressionType`` enum of its protobuf), so the low-bit codecs of :mod:`outer_optim.compression` travel
another way over the same daemon: once hivemind's matchmaking has formed the group, every member
streams its encoded bucket straight to every other member through a protocol handler registered on
the DHT's p2p daemon (authenticated peer ids, private-run membership checked as for the votes), and
every member decodes all of them and averages them itself, in the order of the sorted peer ids.
Every member thus computes the same bits: the vote compares identical averages.

Why an all-gather rather than hivemind's reduce-scatter.  With ``n`` members and ``c`` bytes of one
encoded bucket, each member sends (and receives)

- all-gather: ``(n − 1)·c``;
- reduce-scatter with re-encoding at the part's owner (hivemind's scheme): ``(n − 1)/n·c`` out, and the
  averaged part back to the ``n − 1`` others: ``2·(n − 1)/n·c`` for a dense codec, but for top-k the
  average of ``n`` sparse parts has up to ``n`` times their non-zeros, so the way back costs up to
  ``(n − 1)·c`` and the total exceeds the all-gather's;

so sparse codecs always gather, and dense ones gather at ``n = 2`` (equal bytes, one hop less) and
reduce-scatter beyond (``2/n`` of the all-gather's bytes: half at ``n = 4``), at the price of a second
quantization at each part's owner, whose error the owner may carry into its next round (``carry`` of
:func:`average_encoded`, off by default: it measured worse).  In the reduce-scatter, member
``j`` of the sorted ids owns the ``j``-th of ``n`` block-aligned parts: it decodes the members' parts,
averages them, encodes the average once and sends it to all, and every member (the owner included)
decodes the same bytes, so the averages stay bit-identical.

Members behind NAT.  Members behind NAT that take part in hole punching (``punch:`` endpoints, see
:mod:`peers.wire.transport`) connect to each other directly and own their parts as any member.  When two or
more members of a group cannot be reached and some of them do not punch (``lane:`` endpoints), every part
one of them sends another crosses a reachable member twice (it is relayed), so those members own no part (:func:`part_owners`): they send their whole payload to the
reachable owners and take the averaged parts back, a star through the reachable members, as hivemind's
client-mode peers do.  With ``h`` hidden members and one reachable, the reachable member then carries
``h·c`` each way instead of ``2·h²/n·c`` (its own parts and the relayed ones): at ``n = 3``, ``2·c`` instead of
``8/3·c``.  All reachable, it would carry ``4/3·c``, which no routing reaches with one reachable member: it
alone must take in both hidden members' payloads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.p2p import P2PContext, PeerID

from outer_optim.compression import Payload, reduce_scatters
from outer_optim.compression.entropy import pack, unpack, unpack_at_most
from outer_optim.tensors import all_finite
from peers.aggregation import aggregate, member_norm_check, member_norms, outliers, spread, sum_of_squares
from peers.discovery.membership import MemberCheck, punchable, takes_connections
from peers.wire.inbox import GONE, MAX_GROUP, Inbox, LateAnswers
from peers.wire.p2p_loop import Handler, _submit, message_class, spawn
from peers.wire.round_keys import names_group
from peers.wire.transport import GoneError, Transport, TransportError, send_all

log = logging.getLogger(__name__)

Part = message_class("Part", [("key", "string"), ("offset", "uint64"), ("total", "uint64"), ("data", "bytes"),
                              ("group", "string", "repeated")])
"""One piece of an encoded bucket: the exchange key, where the piece starts, the payload's size, its bytes."""
Ack = message_class("Ack", [("accepted", "bool")])

PIECE = 1 << 20
"""Bytes per streamed message (hivemind's daemon refuses messages above 4 MiB)."""
MAX_KEYS = 16
"""Exchanges buffered for rounds not yet held here (a member may send before our matchmaking ends)."""


STAR_PIECES = 8
"""Pieces a star's reduce-scatter is cut into (see :func:`average_encoded`)."""
MIN_PIECE = 1 << 16
"""Values in the smallest such piece."""


def part_bounds(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, numel)``, cut at multiples of ``align`` (some may be empty)."""
    blocks = -(-numel // align)
    cuts = [min(numel, (blocks * j // parts) * align) for j in range(parts + 1)]
    return list(zip(cuts, cuts[1:]))


def part_owners(peers: Sequence[str], endpoints: Mapping[str, str], unpunched: Collection[str] = ()
                ) -> Collection[str]:
    """The members of a reduce-scatter that own a part: all of them, unless two or more cannot be reached (their
    endpoint is a lane), not all of those take part in hole punching, and one can be reached, then only those
    that can (see the module's docstring).  ``endpoints``: the members' transport endpoints (none known, over
    hivemind's daemon: all own a part); ``unpunched``: members behind NAT that failed a punch lately (they
    count as not punching: their NAT, or another's, gives each destination its own port)."""
    reachable = [p for p in peers if takes_connections(endpoints.get(p, ""))]
    hidden = [p for p in peers if endpoints.get(p, "") and p not in reachable]
    if all(punchable(endpoints[p]) and p not in unpunched for p in hidden):
        return peers  # they connect to each other through their NATs
    return reachable if len(hidden) >= 2 and reachable else peers


@dataclass
class Exchanged:
    """What :meth:`EncodedChannel.exchange` got."""

    got: dict[str, bytes]
    """The payloads received, decoded (:mod:`outer_optim.compression.entropy`) and of the expected size, by
    member."""
    missing: list[str]
    """Members whose payload never came or had another size."""
    declined: list[str]
    """Those of them that declined (see :meth:`EncodedChannel.decline`)."""
    gone: list[str]
    """Those of them whose address refused our part or another member's (who told us): their process is gone
    (direct transport only)."""
    bytes_sent: int
    """Bytes sent on the wire (after entropy coding)."""
    bytes_received: int
    """Bytes of the payloads taken, as they came on the wire."""


class EncodedChannel:
    """Exchanges this peer's encoded buckets of one averager ``prefix`` with the group members.

    ``max_bytes``: the largest payload taken (the codec's size of the bucket: anything larger is refused,
    and a payload of another size than expected does not count); ``members``: in a private run, who may
    send; ``entropy_coding``: Huffman-code what we send (:mod:`outer_optim.compression.entropy`; we read either
    form)."""

    def __init__(self, dht: hivemind.DHT, prefix: str, max_bytes: int, members: MemberCheck | None = None,
                 ttl: float = 120.0, entropy_coding: bool = True):
        self.dht, self.members, self.max_bytes = dht, members, max_bytes + 1  # + entropy coding's flag byte
        self.entropy_coding = entropy_coding
        self.name = f"{prefix}::diloco.parts"
        self.box = Inbox(ttl, max_keys=MAX_KEYS)
        self._declined = LateAnswers()
        """Exchanges we declined: a part that comes later is declined at once (see :meth:`decline`)."""
        self._sends: set[asyncio.Future] = set()
        self._handler = Handler(dht, self.name, self._on_parts, Part, stream_input=True)

    async def _on_parts(self, requests: AsyncIterator[Any], context: P2PContext) -> Any:
        sender = str(context.remote_id)
        if self.members and not await self.members.allows(sender):
            return Ack(accepted=False)
        key, buf, group = None, bytearray(), ()
        async for part in requests:
            key, group = (part.key, list(part.group)) if key is None else (key, group)
            if part.key != key or part.total > self.max_bytes or part.offset != len(buf) \
                    or len(buf) + len(part.data) > part.total:
                log.warning("refused an encoded pseudo-gradient from %s: malformed or of the wrong size", sender)
                return Ack(accepted=False)
            buf += part.data
        if key is None or len(buf) != part.total:
            return Ack(accepted=False)
        self.box.put(key, sender, bytes(buf), group)
        timeout = self._declined.newcomer(key, sender)
        if timeout is not None:
            spawn(self._send(sender, key, b"", timeout), self._sends)
        return Ack(accepted=True)

    def exchange(self, key: str, group: Sequence[str], outgoing: dict[str, bytes], expect: dict[str, int],
                 timeout: float) -> Exchanged:
        """Send ``outgoing[p]`` to each member ``p`` of ``group`` (sorted, us included) and wait (at most
        ``timeout`` seconds) for a payload of ``expect[p]`` bytes from each member of ``expect``."""
        deadline = time.monotonic() + timeout
        packed: dict[int, bytes] = {}  # one coding per distinct payload (an all-gather sends one to all)
        for b in outgoing.values():
            if id(b) not in packed:
                packed[id(b)] = pack(b, self.entropy_coding)
        wire = {p: packed[id(b)] for p, b in outgoing.items()}
        self.box.hold(key)
        try:
            for p, data in wire.items():  # not awaited: a slow member must not hold up the others
                _submit(self._send(p, key, data, timeout, group))
            got = self.box.wait_for(key, lambda received: all(p in received for p in expect), deadline)
        finally:
            self.box.release(key, drop=True)
        payloads = {p: unpack(got[p], expect[p]) for p in expect if p in got}
        ok = {p: b for p, b in payloads.items() if b is not None and len(b) == expect[p]}
        missing = [p for p in expect if p not in ok]
        return Exchanged(ok, missing, [p for p in missing if p in got and not got[p]], [],
                         sum(len(b) for b in wire.values()), sum(len(got[p]) for p in ok))

    def decline(self, key: str, peers: Sequence[str], timeout: float) -> None:
        """Tell ``peers``, who sent us parts on ``key``, that we are not in their exchange (an empty payload
        where one was expected): they stop waiting for ours at once, and so do members whose parts come later.
        Does not wait for them."""
        self._declined.remember(key, peers, timeout)
        for p in peers:
            _submit(self._send(p, key, b"", timeout))

    def all_gather(self, key: str, me: str, peers: Sequence[str], payload: bytes, timeout: float) -> Exchanged:
        """Send ``payload`` to every member of ``peers`` but ``me`` and wait for theirs (of the same size);
        ``got`` then holds ours too."""
        others = [p for p in peers if p != me]
        out = self.exchange(key, peers, {p: payload for p in others}, {p: len(payload) for p in others}, timeout)
        out.got[me] = payload
        return out

    async def _send(self, peer: str, key: str, payload: bytes, timeout: float, group: Sequence[str] = ()) -> None:
        async def pieces() -> AsyncIterator[Any]:
            for start in range(0, max(1, len(payload)), PIECE):  # the group goes with the first piece only
                yield Part(key=key, offset=start, total=len(payload), data=payload[start:start + PIECE],
                           group=() if start else group)

        try:
            reply = await asyncio.wait_for(self._handler.p2p.call_protobuf_handler(
                PeerID.from_base58(peer), self.name, pieces(), Ack), timeout)
            if not reply.accepted:
                log.debug("%s refused our encoded pseudo-gradient", peer)
        except Exception as e:  # unreachable or gone: the member's wait ends by its timeout, the round fails
            log.debug("could not send our encoded pseudo-gradient to %s: %s", peer, e)

    def close(self) -> None:
        """Stop taking payloads (the DHT and its daemon are the caller's)."""
        self._handler.close()


class DirectChannel:
    """The same exchange as :class:`EncodedChannel`, over this rank's :class:`~peers.wire.transport.Transport`
    (straight TCP between the members' ranks, as fast as a gloo all-reduce; see :mod:`peers.wire.transport`).
    :attr:`endpoints` maps the members' peer ids to their transport endpoints (filled from the group's
    metadata before each exchange).  Payloads are sent from the caller's buffers and read into one buffer
    each; entropy coding (``entropy_coding``) applies as on the p2p daemon."""

    def __init__(self, transport: Transport, max_bytes: int, entropy_coding: bool = False):
        self.transport, self.max_bytes, self.entropy_coding = transport, max_bytes + 1, entropy_coding
        self.box = transport.box
        self.endpoints: dict[str, str] = {}
        self._declined = LateAnswers()
        transport.handlers[""] = self._on_message

    def _on_message(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        if isinstance(extra, dict) and "gone" in extra:
            self._heard_gone(key, sender, extra)
            return True
        timeout = self._declined.newcomer(key, sender)
        if timeout is not None and self._endpoint(sender):  # a round we declined: say so again
            threading.Thread(target=self._send, args=(sender, key, b"", timeout, ()), daemon=True).start()
        if isinstance(extra, dict) and extra.get("packed"):  # entropy-coded on the wire: decode it here
            raw = unpack_at_most(payload, self.max_bytes)
            if raw is None:
                log.warning("refused an encoded pseudo-gradient from %s: malformed or too large", sender)
                return True
            self.box.put(key, sender, raw, extra.get("group", ()))
            return True
        return False

    def exchange(self, key: str, group: Sequence[str], outgoing: dict[str, Payload], expect: dict[str, int],
                 timeout: float) -> Exchanged:
        """As :meth:`EncodedChannel.exchange`."""
        deadline = time.monotonic() + timeout
        packed: dict[int, Payload] = {}  # one coding per distinct payload (an all-gather sends one to all)
        for b in outgoing.values():
            if id(b) not in packed:
                packed[id(b)] = pack(b) if self.entropy_coding and len(b) else b
        wire = {p: packed[id(b)] for p, b in outgoing.items()}
        self.box.hold(key)
        try:
            for p, data in wire.items():  # one thread each: a slow member must not hold up the others
                threading.Thread(target=self._send, args=(p, key, data, timeout, group), daemon=True).start()
            got = self.box.wait_for(key, lambda received: all(p in received for p in expect), deadline)
        finally:
            self.box.release(key, drop=True)
        gone = [p for p in expect if got.get(p) is GONE]
        ok = {p: got[p] for p in expect if p in got and p not in gone and len(got[p]) == expect[p]}
        missing = [p for p in expect if p not in ok]
        return Exchanged(ok, missing, [p for p in missing if p in got and p not in gone and not len(got[p])], gone,
                         sum(len(b) for b in wire.values()), sum(len(got[p]) for p in ok))

    def decline(self, key: str, peers: Sequence[str], timeout: float) -> None:
        """As :meth:`EncodedChannel.decline`."""
        self._declined.remember(key, peers, timeout)
        for p in peers:
            threading.Thread(target=self._send, args=(p, key, b"", timeout, ()), daemon=True).start()

    def all_gather(self, key: str, me: str, peers: Sequence[str], payload: Payload, timeout: float) -> Exchanged:
        """As :meth:`EncodedChannel.all_gather`."""
        others = [p for p in peers if p != me]
        out = self.exchange(key, peers, {p: payload for p in others}, {p: len(payload) for p in others}, timeout)
        out.got[me] = payload
        return out

    def _endpoint(self, peer: str) -> str | None:
        """Where ``peer``'s rank is reached: from the group's metadata, else as it announced itself when it called
        this rank (a member of a group this rank never learned of, whose parts it declines)."""
        return self.endpoints.get(peer) or self.transport.callers.get(peer)

    def _send(self, peer: str, key: str, payload: Payload, timeout: float, group: Sequence[str]) -> None:
        endpoint = self._endpoint(peer)
        if endpoint is None:
            log.debug("no transport endpoint for %s: its part of %s is not sent", peer, key)
            return
        try:
            extra = {"group": list(group)} if group else {}
            if self.entropy_coding and len(payload):
                extra["packed"] = True
            self.transport.send(endpoint, key, payload, time.monotonic() + timeout, extra or None)
        except GoneError as e:  # it will not send its part either: the wait for it ends now, the round fails
            log.info("%s", e)
            self.box.put(key, peer, GONE)
            self._tell_gone(key, peer, group, timeout)
        except TransportError as e:  # the member's wait ends by its timeout, the round fails
            log.debug("could not send our part of %s to %s: %s", key, peer, e)

    def _tell_gone(self, key: str, gone: str, group: Sequence[str], timeout: float) -> None:
        """Tell the group's other members that ``gone`` is gone, so that their waits for its part on ``key`` end
        now too.  A member whose part reached ``gone`` before it died would otherwise learn of it only when its
        wait times out, and the members left would go round again at different times and miss each other.
        Runs on the sending thread of our part to ``gone`` (its wait here already ended)."""
        extra = {"gone": gone, "group": list(group)}
        endpoints = [self._endpoint(p) for p in group if p not in (gone, self.transport.peer_id)]
        send_all(self.transport, [(e, key, b"", extra) for e in endpoints if e is not None],
                 time.monotonic() + timeout)

    def _heard_gone(self, key: str, sender: str, extra: dict) -> None:
        """A member of ``key``'s group says another one is gone (see :meth:`_tell_gone`): stop waiting for it.
        Only a member of the group the key names is heard, about another member of it."""
        group, gone = extra.get("group"), str(extra.get("gone"))
        if (isinstance(group, list) and len(group) <= MAX_GROUP and sender in group and gone in group
                and gone != sender and names_group(key, sorted(map(str, group)))):
            log.info("%s says %s is gone (on %s)", sender, gone, key)
            self.box.put(key, gone, GONE)
        else:
            log.warning("ignored a notice from %s that %s is gone: not two members of the group of %s",
                        sender, gone, key)

    def close(self) -> None:
        """Stop answering on the transport (the transport is the caller's)."""
        if self.transport.handlers.get("") == self._on_message:
            del self.transport.handlers[""]


@dataclass
class EncodedAverage:
    """What :func:`average_encoded` did."""

    mean: torch.Tensor | None
    """The group's weighted average, identical on every member; None when a part is missing."""
    missing: list[str] = field(default_factory=list)
    """Members whose part never came (or had another size)."""
    declined: list[str] = field(default_factory=list)
    """Those of them that declined, being alive outside the group."""
    gone: list[str] = field(default_factory=list)
    """Those of them whose address refused our part: their process is gone."""
    bytes_sent: int = 0
    bytes_received: int = 0
    carry: torch.Tensor | None = None
    """The owner's error feedback after this exchange (see :func:`average_encoded`); None without one."""
    rejected: list[str] = field(default_factory=list)
    """Members whose Δ (or, in a reduce-scatter, whose part this member owned) failed the member check and counted
    for nothing (see :func:`aggregate_checked`)."""

    def failure(self, group_size: int) -> tuple[str, int]:
        """Why a group of ``group_size`` got no :attr:`mean`, and how many members are left alive (those whose
        part came, and those that declined: alive outside the group, they go round again with us)."""
        reason = f"{len(self.missing)} of {group_size} island(s) did not send their encoded pseudo-gradient"
        if self.declined:
            reason += f" ({len(self.declined)} never learned of the group)"
        if self.gone:
            reason += f" ({len(self.gone)} gone: nothing listens at its address)"
        return reason, group_size - len(self.missing) + len(self.declined)


def average_encoded(channel: EncodedChannel, codec: Any, key: str, me: str, peers: list[str],
                    weights: dict[str, float], payload: bytes, numel: int, timeout: float,
                    carry: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    sent: torch.Tensor | None = None, owners: Collection[str] | None = None,
                    groups: Sequence[Sequence[str]] | None = None, rule: str = "mean",
                    check: float = 0.0, outlier: float = 0.0) -> EncodedAverage:
    """The group's weighted average of the members' encoded buckets (``payload`` is ours), by all-gather
    or reduce-scatter as :func:`reduce_scatters` says.

    ``carry`` (``numel`` values, or None for no owner feedback): what the re-encoding of averaged parts
    owned here left out in earlier rounds.  In a reduce-scatter it is added to the average of the part
    this member owns before that part is encoded, and the result's ``carry`` holds what this encoding
    left out, on the owned part (zero elsewhere: a part owned before and not now is dropped); an
    all-gather re-encodes nothing and hands ``carry`` back as it was.  ``out``: where to write the average
    (``numel`` values; a new tensor when None); ``sent``: what our ``payload`` decodes to, when the caller has
    it already (not decoded again); ``owners``: the members that own a part of a reduce-scatter (None: all; see
    :func:`part_owners`): two members that own none exchange nothing; ``groups``: the members split into groups
    (:func:`peers.group.roster.split_groups`), which average inside themselves and then across, a part among one
    member of each group (:func:`_two_levels`; dense codecs, every member owning a part, no owner feedback).

    ``rule`` (:data:`peers.aggregation.AGGREGATES`): ``mean``, or a robust rule, which every member computes over
    every member's whole Δ (an all-gather: no member's share of the work is taken on trust); ``check``: a member
    whose Δ (or part) is not finite or of a norm above ``check`` × the median counts for nothing (0: only the
    finiteness check), see :func:`aggregate_checked`; ``outlier``: under a robust rule, a member whose Δ lies farther
    from the aggregate than this many times the median member norm is rejected too."""
    robust = rule != "mean"
    if (not robust and groups is not None and len(groups) > 1 and reduce_scatters(codec, len(peers))
            and carry is None and (owners is None or set(owners) >= set(peers))):
        return _two_levels(channel, codec, key, me, peers, [sorted(g) for g in groups], weights, payload, numel,
                           timeout, out, sent, check)
    if robust or not reduce_scatters(codec, len(peers)):
        gathered = channel.all_gather(key, me, peers, payload, timeout)
        result = EncodedAverage(None, gathered.missing, gathered.declined, gathered.gone, gathered.bytes_sent,
                                gathered.bytes_received, carry)
        if not result.missing:
            values = {p: sent if p == me and sent is not None else codec.decode(gathered.got[p], numel) for p in peers}
            result.mean, result.rejected = aggregate_checked(values, weights, rule, check, out, outlier=outlier)
        return result

    mean = out if out is not None else torch.empty(numel)
    if codec.lossy:  # parts are cut at blocks: each re-encodes to the same codes
        values: torch.Tensor | memoryview = sent if sent is not None else codec.decode(payload, numel)
    else:  # the payload is the values: parts are views of it
        values = memoryview(payload).cast("B")
    holders = [p for p in peers if owners is None or p in owners]
    # a star (hidden members own nothing) goes in pieces, so that the owners send the average of the first
    # pieces back while the last still come in: their one link then carries both ways at once (a connection
    # carries one message at a time, so the pieces travel in waves of the transport's streams; waiting for
    # each piece before sending the next measured slower over 100 ms of round trip)
    count = STAR_PIECES if len(holders) < len(peers) else 1
    ranges = [(lo, hi) for lo, hi in part_bounds(numel, max(1, min(count, numel // MIN_PIECE)), codec.block)
              if hi > lo]
    if len(ranges) == 1:
        return _reduce_scatter(channel, codec, key, me, peers, holders, weights, values, numel, timeout, carry,
                               mean, check)
    width = 1 if codec.lossy else len(values) // numel

    def piece(i: int) -> EncodedAverage:
        lo, hi = ranges[i]
        return _reduce_scatter(channel, codec, f"{i}.{key}", me, peers, holders, weights,
                               values[lo * width:hi * width], hi - lo, timeout,
                               carry[lo:hi] if carry is not None else None, mean[lo:hi], check)

    with ThreadPoolExecutor(max_workers=len(ranges)) as pool:
        done = list(pool.map(piece, range(len(ranges))))
    result = EncodedAverage(mean, sorted({p for d in done for p in d.missing}),
                            sorted({p for d in done for p in d.declined}), sorted({p for d in done for p in d.gone}),
                            sum(d.bytes_sent for d in done), sum(d.bytes_received for d in done),
                            rejected=sorted({p for d in done for p in d.rejected}))
    if result.missing or any(d.mean is None for d in done):
        result.mean = None
    if carry is not None and all(d.carry is not None for d in done):
        result.carry = torch.cat([d.carry for d in done])
    return result


def _reduce_scatter(channel: EncodedChannel, codec: Any, key: str, me: str, peers: list[str], holders: list[str],
                    weights: dict[str, float], values: torch.Tensor | memoryview, numel: int, timeout: float,
                    carry: torch.Tensor | None, mean: torch.Tensor, check: float = 0.0) -> EncodedAverage:
    """The reduce-scatter of :func:`average_encoded` over ``numel`` values (``values``: ours, decoded for a
    lossy codec, else the payload's bytes), the parts owned by ``holders``; the average lands in ``mean``."""

    def enc(x: torch.Tensor) -> Payload:
        if not x.numel():
            return b""
        if not codec.lossy:  # the values as they are, finite or not: every member then sees what came
            return memoryview(x.contiguous().numpy()).cast("B")
        if not all_finite(x):  # a lossy code cannot carry it: send nothing, and the members fail the part
            return b""
        return codec.encode(x)

    def dec(b: bytes, n: int) -> torch.Tensor:
        return codec.decode(b, n) if n else torch.zeros(0)

    cuts = dict(zip(holders, part_bounds(numel, len(holders), codec.block)))
    bounds = {p: cuts.get(p, (0, 0)) for p in peers}
    others = [p for p in peers if p != me and (p in cuts or me in cuts)]
    if codec.lossy:
        parts = {p: enc(values[a:b]) for p, (a, b) in bounds.items()}
    else:
        width = len(values) // numel
        parts = {p: values[a * width:b * width] for p, (a, b) in bounds.items()}
    a, b = bounds[me]
    size = codec.nbytes(b - a) if b > a else 0
    # the stage goes first: the key must end with its round (:func:`peers.wire.round_keys.is_on_round`)
    scattered = channel.exchange(f"rs.{key}", peers, {p: parts[p] for p in others}, {p: size for p in others},
                                 timeout)
    result = EncodedAverage(None, scattered.missing, scattered.declined, scattered.gone, scattered.bytes_sent,
                            scattered.bytes_received)
    if result.missing:
        return result
    got = {**scattered.got, me: parts[me]}
    mine = b""
    if carry is not None:
        result.carry = torch.zeros(numel)
    if b > a:
        part, result.rejected = aggregate_checked({p: dec(got[p], b - a) for p in peers}, weights, "mean", check,
                                                  mean[a:b], exact=False)
        if part is not None and carry is not None:
            part += carry[a:b]
        mine = enc(part) if part is not None else b""
        if part is not None and codec.lossy and len(mine):  # what every member takes: the average as encoded
            decoded = dec(mine, b - a)
            if result.carry is not None:
                result.carry[a:b] = part - decoded
            part.copy_(decoded)
    sizes = {p: codec.nbytes(hi - lo) if hi > lo else 0 for p, (lo, hi) in bounds.items() if p in others}
    gathered = channel.exchange(f"ag.{key}", peers, {p: mine for p in others}, sizes, timeout)
    result.missing, result.declined, result.gone = gathered.missing, gathered.declined, gathered.gone
    result.bytes_sent += gathered.bytes_sent
    result.bytes_received += gathered.bytes_received
    if not result.missing:
        for p, (lo, hi) in bounds.items():
            if p != me and hi > lo:
                mean[lo:hi].copy_(dec(gathered.got[p], hi - lo))
        result.mean = mean
    return result


def _two_levels(channel: EncodedChannel, codec: Any, key: str, me: str, peers: list[str], groups: list[list[str]],
                weights: dict[str, float], payload: bytes, numel: int, timeout: float,
                out: torch.Tensor | None, sent: torch.Tensor | None, check: float = 0.0) -> EncodedAverage:
    """The average of a roster split into ``groups``, in three steps, so that a member talks to its own group and to
    one member of each other group instead of to every member:

    1. inside each group, a reduce-scatter: the bucket is cut into ``P`` parts (``P``: the smallest group's size),
       and the group's ``j``-th member (sorted) takes every member's ``j``-th part and averages it (weighted);
    2. across groups, the ``j``-th members of all groups average their parts (:func:`average_encoded` among them,
       each weighing its group's total weight): every one of them then holds the same bits of part ``j`` of the
       whole roster's average;
    3. inside each group, an all-gather: the ``j``-th member sends its part, encoded, to the rest of its group.

    Every member decodes the same bytes for every part (the ``j``-th members hold the same average and encode it
    alike), so all hold the same bits.  Per member, about ``2c + 2c/P`` bytes each way for a payload of ``c``,
    against ``2c`` for one flat group of every member: the same bytes, over ``|group| + |groups|`` peers instead of
    every one.  A member that cannot do its part (a part missing) tells the members waiting for it at once (an
    empty part), so that a failure ends every member's wait, not only its group's."""
    group = next(g for g in groups if me in g)
    holders = min(len(g) for g in groups)
    mine = group.index(me)
    cuts = part_bounds(numel, holders, codec.block)
    mean = out if out is not None else torch.empty(numel)
    values = sent if sent is not None else codec.decode(payload, numel)
    result = EncodedAverage(None)

    def enc(x: torch.Tensor) -> Payload:
        return codec.encode(x) if x.numel() and all_finite(x) else b""

    def take(step: Exchanged) -> None:
        result.missing = sorted({*result.missing, *step.missing})
        result.declined = sorted({*result.declined, *step.declined})
        result.gone = sorted({*result.gone, *step.gone})
        result.bytes_sent += step.bytes_sent
        result.bytes_received += step.bytes_received

    # 1. the group's parts to their holders
    others = [p for p in group if p != me]
    outgoing = {group[j]: enc(values[a:b]) for j, (a, b) in enumerate(cuts) if group[j] != me}
    held = cuts[mine] if mine < holders else None
    size = codec.nbytes(held[1] - held[0]) if held and held[1] > held[0] else 0
    scattered = channel.exchange(f"g1.{key}", group, outgoing, {p: size for p in others} if held else {}, timeout)
    take(scattered)
    final: Payload = b""
    if held is not None:
        a, b = held
        if not scattered.missing and b > a:
            got = {p: codec.decode(scattered.got[p], b - a) for p in others}
            got[me] = values[a:b]
            # a buffer of its own: the fp32 "codec" sends it without a copy while the step across writes mean[a:b]
            part, result.rejected = aggregate_checked(got, {p: weights[p] for p in group}, "mean", check,
                                                      exact=False)
            # 2. across the groups, among the members holding the same part
            across = sorted(g[mine] for g in groups)
            totals = {g[mine]: float(sum(weights[p] for p in g)) for g in groups}
            crossed = average_encoded(channel, codec, f"g2.{mine}.{key}", me, across, totals,
                                      enc(part) if part is not None else b"", b - a, timeout, out=mean[a:b])
            take(Exchanged({}, crossed.missing, crossed.declined, crossed.gone, crossed.bytes_sent,
                           crossed.bytes_received))
            if crossed.mean is not None:
                final = enc(crossed.mean)
                if codec.lossy and len(final):  # what every member takes for the part: the average as encoded
                    mean[a:b].copy_(codec.decode(final, b - a))
        elif scattered.missing:
            # the members of the other groups holding this part wait for ours: tell them at once
            across = [g[mine] for g in groups if g[mine] != me]
            for stage in ("", "rs."):  # the step across is an all-gather or a reduce-scatter (see average_encoded)
                channel.decline(f"{stage}g2.{mine}.{key}", across, timeout)
    # 3. every part to the whole group (an empty one when this member has none: its group stops waiting)
    sizes = {group[j]: codec.nbytes(b - a) if b > a else 0 for j, (a, b) in enumerate(cuts) if group[j] != me}
    gathered = channel.exchange(f"g3.{key}", group, {p: final for p in others} if held else {}, sizes, timeout)
    take(gathered)
    if result.missing:
        return result
    for j, (a, b) in enumerate(cuts):
        if group[j] != me and b > a:
            mean[a:b].copy_(codec.decode(gathered.got[group[j]], b - a))
    result.mean = mean
    return result


def aggregate_checked(values: dict[str, torch.Tensor], weights: dict[str, float], rule: str, check: float,
                      out: torch.Tensor | None = None, exact: bool = True, outlier: float = 0.0
                      ) -> tuple[torch.Tensor | None, list[str]]:
    """``rule``'s aggregate of the members' ``values`` once the member check has run: a member whose values are not
    finite, or whose norm is above ``check`` × the group's median (0: no bound), counts for nothing
    (:func:`peers.aggregation.member_norm_check`).  Returns (the aggregate, or None when no member is left; the
    members rejected: those, and under a robust rule those whose Δ lies farther from the aggregate than ``outlier``
    × the median member norm, :func:`peers.aggregation.outliers`, 0: none so; the aggregate is then taken again
    without them).  The same bits on every member that
    checks and aggregates the same values; ``exact`` False (one member alone decides, a part's owner) takes torch's
    norms, several times faster, whose last bits depend on the thread count."""
    norms = member_norms(values) if exact else {p: float(torch.linalg.vector_norm(v)) for p, v in values.items()}
    rejected = member_norm_check(norms, check)
    counted = {p: 0.0 if p in rejected else weights[p] for p in values}
    if not any(w > 0 for w in counted.values()):
        return None, rejected
    if rejected:
        log.warning("left out the pseudo-gradient of %s: not finite, or its norm above %g times the group's median",
                    ", ".join(p[-8:] for p in rejected), check)
    measured: dict[str, float] = {}
    result = aggregate(values, counted, rule, out, distances=measured)
    if rule != "mean" and outlier > 0:
        kept = {p: v for p, v in values.items() if counted[p] > 0}
        if set(measured) != set(kept):  # the rule did not measure them (trimmed-mean): once, for both below
            measured = {p: math.sqrt(sum_of_squares(v, result)) for p, v in kept.items()}
        # an honest member on data of its own sits farther out as a run goes on: the margin is worth watching
        log.info("distances to the %s aggregate, in median member norms (past %g and pointing away: rejected): %s",
                 rule, outlier, " ".join(f"{p[-8:]}={d:.2f}" for p, d in sorted(spread(kept, result, measured,
                                                                                      norms).items())))
        far = outliers(kept, result, outlier, measured, norms)
        if far:
            # aggregated again without it: clipped to τ, a reversed Δ still pulled θ_global τ the wrong way in each
            # round until its strikes left it out (small, flip under centered-clip: 1.025× the clean loss, not 1.00)
            log.warning("left out the pseudo-gradient of %s: more than %g times the group's median norm away from "
                        "the %s aggregate", ", ".join(p[-8:] for p in far), outlier, rule)
            rejected = sorted({*rejected, *far})
            counted = {p: 0.0 if p in far else w for p, w in counted.items()}
            result = aggregate(values, counted, rule, out)
    return result, rejected
