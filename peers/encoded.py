"""Encoded pseudo-gradients between the members of a group, over hivemind's p2p daemon.

hivemind's butterfly all-reduce can carry only the codecs in its own table (it decodes a part by the
``CompressionType`` enum of its protobuf), so the low-bit codecs of :mod:`outer_optim.codecs` travel
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
would send ``2/n`` of it by reduce-scatter beyond (half at ``n = 4``), at the price of a second
quantization at the owner that no island's error feedback sees.  We gather for every codec: one exact
path, the same on every member.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import hivemind
import torch
from hivemind.p2p import P2PContext, PeerID

from peers.p2p_loop import Handler, _submit, message_class
from peers.vote import Inbox, MemberCheck

log = logging.getLogger(__name__)

Part = message_class("Part", [("key", "string"), ("offset", "uint64"), ("total", "uint64"), ("data", "bytes")])
"""One piece of an encoded bucket: the exchange key, where the piece starts, the payload's size, its bytes."""
Ack = message_class("Ack", [("accepted", "bool")])

PIECE = 1 << 20
"""Bytes per streamed message (hivemind's daemon refuses messages above 4 MiB)."""
MAX_KEYS = 16
"""Exchanges buffered for rounds not yet held here (a member may send before our matchmaking ends)."""


def allgather_bytes(payload_bytes: int, group_size: int) -> int:
    """Bytes one member sends (and receives) in the all-gather of ``payload_bytes`` each."""
    return max(0, group_size - 1) * payload_bytes


def weighted_mean(values: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """Σ wᵢ·vᵢ / Σ wᵢ in fp32, summed in the order of the sorted member ids: the same bits on every member."""
    order = sorted(values)
    total = sum(weights[p] for p in order)
    out = torch.zeros_like(values[order[0]], dtype=torch.float32)
    for p in order:
        out.add_(values[p], alpha=weights[p] / total)
    return out


class EncodedChannel:
    """Exchanges this peer's encoded buckets of one averager ``prefix`` with the group members.

    ``payload_bytes``: the size every member's payload must have (the codec's size of the bucket:
    anything else is refused); ``members``: in a private run, who may send."""

    def __init__(self, dht: hivemind.DHT, prefix: str, payload_bytes: int, members: MemberCheck | None = None,
                 ttl: float = 120.0):
        self.dht, self.members, self.payload_bytes = dht, members, payload_bytes
        self.name = f"{prefix}::diloco.parts"
        self.box = Inbox(ttl, max_keys=MAX_KEYS)
        self._handler = Handler(dht, self.name, self._on_parts, Part, stream_input=True)

    async def _on_parts(self, requests: AsyncIterator[Any], context: P2PContext) -> Any:
        sender = str(context.remote_id)
        if self.members and not await self.members.allows(sender):
            return Ack(accepted=False)
        key, buf = None, bytearray()
        async for part in requests:
            key = part.key if key is None else key
            if part.key != key or part.total != self.payload_bytes or part.offset != len(buf) \
                    or len(buf) + len(part.data) > self.payload_bytes:
                log.warning("refused an encoded pseudo-gradient from %s: malformed or of the wrong size", sender)
                return Ack(accepted=False)
            buf += part.data
        if key is None or len(buf) != self.payload_bytes:
            return Ack(accepted=False)
        self.box.put(key, sender, bytes(buf))
        return Ack(accepted=True)

    def all_gather(self, key: str, me: str, peers: Sequence[str], payload: bytes, timeout: float
                   ) -> tuple[dict[str, bytes], list[str]]:
        """Send ``payload`` to every member of ``peers`` but ``me`` and wait (at most ``timeout`` seconds)
        for theirs: returns (payload by member, ours included; the members whose payload never came)."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes; this channel carries {self.payload_bytes}")
        others = [p for p in peers if p != me]
        deadline = time.monotonic() + timeout
        self.box.hold(key)
        try:
            for p in others:  # not awaited: a slow member must not hold up the others' payloads
                _submit(self._send(p, key, payload, timeout))
            got = self.box.wait_for(key, lambda received: all(p in received for p in others), deadline)
        finally:
            self.box.release(key, drop=True)
        gathered = {p: got[p] for p in others if p in got}
        gathered[me] = payload
        return gathered, [p for p in others if p not in got]

    async def _send(self, peer: str, key: str, payload: bytes, timeout: float) -> None:
        async def pieces() -> AsyncIterator[Any]:
            for start in range(0, max(1, len(payload)), PIECE):
                yield Part(key=key, offset=start, total=len(payload), data=payload[start:start + PIECE])

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
