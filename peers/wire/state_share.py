"""θ_global and the outer momentum between islands, over the ranks' transports (:mod:`peers.wire.transport`).

Every rank serves its own pieces of any bucket of the canonical layout (the elements of its shards it
contributes to that bucket, see :class:`peers.island.exchange.BucketExchange`), read from the live θ_global under
the caller's lock: nothing is kept aside for joiners.  A joining rank downloads each bucket it owns from
every rank of the island it chose, all requests at once, and assembles the buckets from the pieces: the
state comes at the round's throughput, in parallel over buckets and ranks.  A download counts only when
every element of every bucket came, from one outer step and one config.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from peers.island.exchange import HOST, BucketExchange
from peers.island.layout import Segment
from peers.wire.inbox import GONE
from peers.wire.transport import GoneError, Transport, TransportError

log = logging.getLogger(__name__)

REQUEST = "state?"
"""Key prefix of a request for a bucket's pieces."""
REPLY = "state!"
"""Key prefix of a reply (a piece: values, with the metadata and where they go in the bucket)."""
SERVING = 2
"""Pieces a rank serves at once: each is copied out of θ_global while the lock is held."""

Provider = Callable[[], tuple[dict, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]] | None]
"""What a rank serves, read under the caller's lock: (metadata, θ_global shards, momentum shards), or None
while it serves nothing (it is replacing its θ_global)."""


class StateServer:
    """Answers requests for this rank's pieces of a bucket of θ_global and the outer momentum.

    ``provide`` is called with ``lock`` held; the metadata it returns (outer step, config fingerprint, ...)
    goes with every piece."""

    def __init__(self, transport: Transport, exchange: BucketExchange, provide: Provider, lock: threading.Lock):
        self.transport, self.exchange, self.provide, self.lock = transport, exchange, provide, lock
        self._slots = threading.Semaphore(SERVING)
        transport.handlers[REQUEST] = self._on_request

    def _on_request(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        try:
            request = json.loads(bytes(payload))
            bucket, reply, to = int(request["bucket"]), str(request["reply"]), str(request["reply_to"])
        except (ValueError, KeyError, TypeError):
            log.warning("refused a malformed request for state from %s", sender)
            return True
        if 0 <= bucket < len(self.exchange.layout.buckets):
            threading.Thread(target=self._serve, args=(bucket, reply, to), daemon=True).start()
        return True

    def _serve(self, bucket: int, reply: str, to: str) -> None:
        with self._slots:
            with self.lock:
                try:
                    provided = self.provide()
                    if provided is None:
                        meta, values, segments = {"refused": True}, torch.zeros(0), []
                    else:
                        meta, theta, momentum = provided
                        segments = self.exchange.contribution(bucket)
                        values = torch.cat([on_host(src, segments) for src in (theta, momentum)])
                except Exception as e:  # the joiner hears why at once, instead of waiting out its download
                    log.exception("could not read the state to serve bucket %d", bucket)
                    meta, values, segments = {"refused": True, "error": f"{type(e).__name__}: {e}"[:300]}, \
                        torch.zeros(0), []
            extra = {"meta": meta, "segments": [[s.bucket_offset, s.rows, s.row_len, s.row_stride] for s in segments]}
            try:
                self.transport.send(to, reply, memoryview(values.numpy()).cast("B"), time.monotonic() + 60.0, extra)
            except TransportError as e:
                log.info("could not serve state to %s: %s", to, e)

    def close(self) -> None:
        """Stop serving (the transport is the caller's)."""
        self.transport.handlers.pop(REQUEST, None)


def on_host(tensors: Mapping[str, torch.Tensor], segments: list[Segment]) -> torch.Tensor:
    """The elements of ``tensors`` at ``segments``, as one fp32 tensor on the host, wherever the tensors are (θ_global
    on a GPU with ``--diloco.master_device cuda``, the momentum's zeros on the host before the first outer step):
    cut where they are, then copied to the host once."""
    if not segments:
        return torch.zeros(0)
    pieces = [s.local_view(tensors[s.name].detach().reshape(-1)).reshape(-1) for s in segments]
    if len({p.device for p in pieces}) > 1:
        pieces = [p.to(HOST) for p in pieces]
    return torch.cat(pieces).to(HOST, torch.float32)


def keep_replies(transport: Transport) -> None:
    """Let ``transport`` take replies to state requests (values and metadata together, in its inbox)."""
    def keep(key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        transport.box.put(key, sender, (payload, extra))
        return True
    transport.handlers[REPLY] = keep


@dataclass
class Downloaded:
    """A bucket of θ_global and of the outer momentum, assembled from a donor island's ranks."""

    meta: dict
    theta: torch.Tensor
    momentum: torch.Tensor


def download(transport: Transport, donors: list[str], buckets: Mapping[int, int], timeout: float,
             tag: str) -> tuple[dict[int, Downloaded], str]:
    """Every bucket of ``buckets`` (index → numel) from every rank of a donor island (``donors``: their
    endpoints), all requests at once.  Returns ({bucket: assembled}, '') when every bucket came whole from one
    outer step and one config, else ({}, why not).  ``tag`` keeps this download's replies apart."""
    deadline = time.monotonic() + timeout
    box = transport.box
    keep_replies(transport)
    keys = {b: f"{REPLY}{tag}.{b}.{transport.peer_id}" for b in buckets}
    for key in keys.values():
        box.hold(key)
    try:
        requests = [(d, b) for b in buckets for d in donors]

        def ask(donor: str, b: int) -> None:
            body = json.dumps({"bucket": b, "reply": keys[b], "reply_to": transport.endpoint}).encode()
            try:
                transport.send(donor, f"{REQUEST}{keys[b]}", body, deadline)
            except GoneError as e:  # it will never answer: the wait for its piece ends now
                log.info("could not ask %s for state: %s", donor, e)
                box.put(keys[b], donor, GONE)
            except TransportError as e:
                log.info("could not ask %s for state: %s", donor, e)

        threads = [threading.Thread(target=ask, args=r, daemon=True) for r in requests]
        for t in threads:
            t.start()
        out: dict[int, Downloaded] = {}
        steps: set = set()
        for b, numel in buckets.items():
            got = box.wait_for(keys[b], lambda m: len(m) >= len(donors), deadline)
            gone = sum(v is GONE for v in got.values())
            if len(got) < len(donors) or gone:
                return {}, (f"{len(donors) - len(got) + gone} of the donor island's {len(donors)} rank(s) did not "
                            f"answer" + (f" ({gone} gone: nothing listens at its address)" if gone else ""))
            pieces = [_piece(v) for v in got.values()]
            if any(p is None for p in pieces):
                return {}, "a donor rank sent a malformed piece of state"
            metas = [p[0] for p in pieces]
            errors = [m["error"] for m in metas if m.get("error")]
            if errors:
                return {}, f"a donor rank could not read its state: {errors[0]}"
            if any(m.get("refused") for m in metas):
                return {}, "the donor island is replacing its own θ_global"
            # where the donor stood in its round's inner steps moves on while it serves; the rest must not
            steps |= {json.dumps({k: v for k, v in m.items() if k != "phase"}, sort_keys=True) for m in metas}
            theta, momentum = torch.full((numel,), float("nan")), torch.full((numel,), float("nan"))
            count = torch.zeros(numel, dtype=torch.int32)
            for _, segments, values in pieces:
                half = values.numel() // 2
                if not _place(theta, count, segments, values[:half]) or not _place(momentum, None, segments,
                                                                                    values[half:]):
                    return {}, "a donor rank's pieces do not fit the bucket"
            if not bool((count == 1).all()):
                return {}, "the donor island's pieces do not cover the bucket exactly once"
            out[b] = Downloaded(metas[0], theta, momentum)
        if len(steps) > 1:
            return {}, "the donor island's ranks served different outer steps (a round committed meanwhile)"
        return out, ""
    finally:
        for key in keys.values():
            box.release(key, drop=True)


def _piece(value: object) -> tuple[dict, list, torch.Tensor] | None:
    """(metadata, segments, values) of a reply (stored by the transport's inbox as payload + extra)."""
    if not isinstance(value, tuple) or len(value) != 2:
        return None
    payload, extra = value
    if not isinstance(extra, dict) or not isinstance(extra.get("meta"), dict):
        return None
    segments = extra.get("segments")
    if not isinstance(segments, list) or len(payload) % 8:
        return None
    return extra["meta"], segments, torch.frombuffer(payload, dtype=torch.float32) if len(payload) else torch.zeros(0)


def _place(bucket: torch.Tensor, count: torch.Tensor | None, segments: list, values: torch.Tensor) -> bool:
    """Write ``values`` into ``bucket`` at ``segments`` ([offset, rows, row_len, row_stride] each); False if
    they do not fit."""
    pos = 0
    for seg in segments:
        try:
            offset, rows, row_len, stride = (int(x) for x in seg)
        except (TypeError, ValueError):
            return False
        n = rows * row_len
        last = offset + (rows - 1) * stride + row_len
        if min(offset, rows, row_len) < 0 or last > bucket.numel() or pos + n > values.numel():
            return False
        view = bucket.as_strided((rows, row_len), (stride, 1), offset)
        view.copy_(values[pos:pos + n].view(rows, row_len))
        if count is not None:
            count.as_strided((rows, row_len), (stride, 1), offset).add_(1)
        pos += n
    return pos == values.numel()
