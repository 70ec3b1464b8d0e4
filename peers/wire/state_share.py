"""θ_global and the outer momentum between islands, over the ranks' transports (:mod:`peers.wire.transport`).

Every rank serves its own pieces of any bucket of the canonical layout (the elements of its shards it
contributes to that bucket, see :class:`peers.island.exchange.BucketExchange`), read from the live θ_global under
the caller's lock: nothing is kept aside for joiners.  A joining rank downloads each bucket it owns from
every rank of the island it chose, all requests at once, and assembles the buckets from the pieces: the
state comes at the round's throughput, in parallel over buckets and ranks.  A download counts only when
every element of every bucket came, from one outer step and one config.

A download is then checked with other islands (:func:`witness`): the joiner picks a secret seed once the bytes
came, and every rank of a witness island answers with a projection of its pieces on pseudo-random weights drawn
from that seed.  A donor cannot craft a θ_global those projections miss, as it can craft one with the per-chunk
sums the registry vouches for (permuting values inside a chunk), because it never learns the seed.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
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
WITNESS = "print?"
"""Key prefix of a request for keyed prints of this rank's pieces of buckets (a joiner checking a download)."""
PRINTED = "print!"
"""Key prefix of a reply to it (the metadata, and per bucket where the pieces sit and their print)."""
PRINT_TOLERANCE = 1e-9
"""How far two prints of the same values may differ, relative to the sum of |weight × value| (the same fp32
values, summed in fp64 in another order on another machine)."""
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
        transport.handlers[WITNESS] = self._on_request

    def _on_request(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        try:
            request = json.loads(bytes(payload))
            reply, to = str(request["reply"]), str(request["reply_to"])
            if key.startswith(WITNESS):
                buckets, seed = [int(b) for b in request["buckets"]], int(request["seed"])
            else:
                buckets, seed = [int(request["bucket"])], None
        except (ValueError, KeyError, TypeError):
            log.warning("refused a malformed request for state from %s", sender)
            return True
        if buckets and all(0 <= b < len(self.exchange.layout.buckets) for b in buckets):
            threading.Thread(target=self._serve, args=(buckets, seed, reply, to), daemon=True).start()
        return True

    def _serve(self, buckets: list[int], seed: int | None, reply: str, to: str) -> None:
        """Send this rank's pieces of ``buckets``: θ_global and momentum values (one bucket), or with ``seed`` their
        keyed prints (:func:`keyed_print`; computed once the lock is released, from a copy)."""
        with self._slots:
            with self.lock:
                try:
                    provided = self.provide()
                    if provided is None:
                        meta, pieces = {"refused": True}, []
                    else:
                        meta, theta, momentum = provided
                        # a print needs θ alone, and on_host's copy of it: no second copy into a cat of one
                        pieces = [(b, segments, on_host(theta, segments) if seed is not None else
                                   torch.cat([on_host(src, segments) for src in (theta, momentum)]))
                                  for b in buckets for segments in [self.exchange.contribution(b)]]
                except Exception as e:  # the joiner hears why at once, instead of waiting out its download
                    log.exception("could not read the state to serve bucket(s) %s", buckets)
                    meta, pieces = {"refused": True, "error": f"{type(e).__name__}: {e}"[:300]}, []
            extra: dict = {"meta": meta}
            if seed is None:
                values = pieces[0][2] if pieces else torch.zeros(0)
                extra["segments"] = _wire(pieces[0][1]) if pieces else []
            else:
                values = torch.zeros(0)
                extra["prints"] = [[b, _wire(segments), _rank_print(v, segments, seed, b)] for b, segments, v in pieces]
            try:
                self.transport.send(to, reply, memoryview(values.numpy()).cast("B"), time.monotonic() + 60.0, extra)
            except TransportError as e:
                log.info("could not serve state to %s: %s", to, e)

    def close(self) -> None:
        """Stop serving (the transport is the caller's)."""
        self.transport.handlers.pop(REQUEST, None)
        self.transport.handlers.pop(WITNESS, None)


def _wire(segments: list[Segment]) -> list[list[int]]:
    """Where ``segments`` sit in their bucket, as they travel: [offset, rows, row_len, row_stride] each."""
    return [[s.bucket_offset, s.rows, s.row_len, s.row_stride] for s in segments]


def _rank_print(values: torch.Tensor, segments: list[Segment], seed: int, bucket: int) -> float:
    """:func:`keyed_print` of a rank's pieces of a bucket (``values``: their elements, segment after segment)."""
    total, pos = 0.0, 0
    for seg in segments:
        total += keyed_print(values[pos:pos + seg.numel].view(seg.rows, seg.row_len), seg.bucket_offset,
                             seg.row_stride, seed, bucket)[0]
        pos += seg.numel
    return total


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
    """Let ``transport`` take replies to state and print requests (values and metadata together, in its inbox)."""
    def keep(key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        transport.box.put(key, sender, (payload, extra))
        return True
    transport.handlers[REPLY] = transport.handlers[PRINTED] = keep


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


def _segment(seg: object, numel: int) -> tuple[int, int, int, int] | None:
    """(offset, rows, row_len, row_stride) of a segment as it travels, or None when it is malformed or runs outside
    a bucket of ``numel`` elements (a peer's: anything may come)."""
    try:
        offset, rows, row_len, stride = (int(x) for x in seg)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        return None
    if min(offset, rows, row_len, stride) < 0 or (rows and row_len and offset + (rows - 1) * stride + row_len > numel):
        return None
    return offset, rows, row_len, stride


def _in_bucket(bucket: torch.Tensor, seg: tuple[int, int, int, int]) -> torch.Tensor:
    """The ``(rows, row_len)`` view of a checked segment (:func:`_segment`) inside a 1-D bucket tensor."""
    offset, rows, row_len, stride = seg
    return bucket.as_strided((rows, row_len), (stride, 1), offset)


def _place(bucket: torch.Tensor, count: torch.Tensor | None, segments: list, values: torch.Tensor) -> bool:
    """Write ``values`` into ``bucket`` at ``segments`` ([offset, rows, row_len, row_stride] each); False if
    they do not fit."""
    pos = 0
    for seg in segments:
        checked = _segment(seg, bucket.numel())
        if checked is None or pos + checked[1] * checked[2] > values.numel():
            return False
        n = checked[1] * checked[2]
        _in_bucket(bucket, checked).copy_(values[pos:pos + n].view(checked[1], checked[2]))
        if count is not None:
            _in_bucket(count, checked).add_(1)
        pos += n
    return pos == values.numel()


_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""splitmix64's constants."""
_WORD = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit word as torch's int64 holds it."""
    x &= _WORD
    return x - (1 << 64) if x >> 63 else x


def _shifted(z: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift of int64 words (torch's is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mixed(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer over int64 words (products wrap, as the 64-bit words they stand for)."""
    z = (z ^ _shifted(z, 30)) * _signed(_MIX[1])
    z = (z ^ _shifted(z, 27)) * _signed(_MIX[2])
    return z ^ _shifted(z, 31)


def keyed_weights(at: torch.Tensor, seed: int, bucket: int) -> torch.Tensor:
    """fp64 weights in [-1, 1) for the bucket offsets ``at``: splitmix64 of each offset under a key drawn from
    (``seed``, ``bucket``), so that any rank computes the weights of its own elements and nobody who lacks the seed
    can tell them."""
    key = int(_mixed(torch.tensor([_signed(seed * _MIX[0] + bucket)]))[0])
    return _shifted(_mixed(at * _signed(_MIX[0]) + key), 11).double() * 2.0 ** -52 - 1.0


PRINT_BLOCK = 1 << 15
"""Elements weighed at once: the words of a block stay in the cache through splitmix64's dozen passes (3x faster
than one pass over a whole bucket)."""


def keyed_print(rows: torch.Tensor, offset: int, stride: int, seed: int, bucket: int) -> tuple[float, float]:
    """The projection of a segment of bucket ``bucket`` (``rows``: its values, a ``(rows, row_len)`` tensor whose
    rows start at bucket offsets ``offset``, ``offset + stride``, ...) on :func:`keyed_weights`, and the sum of the
    terms' magnitudes (what two prints of the same values may differ by is relative to it); in fp64."""
    n_rows, row_len = rows.shape
    total = magnitude = 0.0
    across = max(1, PRINT_BLOCK // max(row_len, 1))  # rows per block
    for r in range(0, n_rows, across):
        for c in range(0, row_len, PRINT_BLOCK):
            block = rows[r:r + across, c:c + PRINT_BLOCK]
            at = (offset + c + torch.arange(r, r + block.shape[0]).unsqueeze(1) * stride
                  + torch.arange(block.shape[1]))
            terms = block.double() * keyed_weights(at, seed, bucket)
            total += float(terms.sum())
            magnitude += float(terms.abs().sum())
    return total, magnitude


def witness(transport: Transport, islands: list[list[str]], theta: Mapping[int, torch.Tensor], timeout: float,
            tag: str) -> list[tuple[list[dict], bool] | None]:
    """Check downloaded buckets of θ_global (``theta``: bucket → values) with witness ``islands`` (the transport
    endpoints of each one's ranks), all at once, under a seed picked now: each rank of each island answers with
    :func:`keyed_print` of its pieces of every bucket.  Per island: (its ranks' metadata, whether its ranks' prints of
    each bucket add up to the print of the downloaded bucket), or None when its answer was not whole (a rank silent,
    refusing or malformed, or pieces that do not cover each bucket exactly once)."""
    deadline = time.monotonic() + timeout
    box = transport.box
    keep_replies(transport)
    seed = secrets.randbits(62)
    keys = [f"{PRINTED}{tag}.{i}.{transport.peer_id}" for i in range(len(islands))]
    for key in keys:
        box.hold(key)
    try:
        body = {"buckets": sorted(theta), "seed": seed, "reply_to": transport.endpoint}

        def ask(endpoint: str, key: str) -> None:
            try:
                transport.send(endpoint, f"{WITNESS}{key}", json.dumps({**body, "reply": key}).encode(), deadline)
            except TransportError as e:
                log.info("could not ask %s to witness a download: %s", endpoint, e)

        for key, ranks in zip(keys, islands):
            for endpoint in ranks:
                threading.Thread(target=ask, args=(endpoint, key), daemon=True).start()
        # the downloaded buckets' prints while the islands compute theirs (an island's ranks' prints add up to them)
        mine = {b: (*keyed_print(v.view(1, -1), 0, v.numel(), seed, b), v.numel()) for b, v in theta.items()}
        return [_compare(box.wait_for(key, lambda m, n=len(ranks): len(m) >= n, deadline), len(ranks), mine)
                for key, ranks in zip(keys, islands)]
    finally:
        for key in keys:
            box.release(key, drop=True)


def _compare(got: dict, ranks: int, mine: Mapping[int, tuple[float, float, int]]) -> tuple[list[dict], bool] | None:
    """A witness island's answer (its ranks' replies) against the downloaded buckets' prints (``mine``: bucket →
    print, magnitude and size): see :func:`witness`."""
    replies = [v[1] for v in got.values() if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict)]
    if len(replies) < ranks or any(not isinstance(r.get("meta"), dict) or r["meta"].get("refused")
                                   or not isinstance(r.get("prints"), list) for r in replies):
        return None
    count = {b: torch.zeros(numel, dtype=torch.int32) for b, (_, _, numel) in mine.items()}
    named = dict.fromkeys(mine, 0)
    theirs = dict.fromkeys(mine, 0.0)
    for r in replies:
        for entry in r["prints"]:
            try:
                b, segments, printed = int(entry[0]), list(entry[1]), float(entry[2])
            except (TypeError, ValueError, IndexError):
                return None
            checked = [_segment(seg, mine[b][2]) if b in mine else None for seg in segments]
            if None in checked:
                return None
            named[b] += sum(rows * row_len for _, rows, row_len, _ in checked)
            if named[b] > mine[b][2]:
                return None  # more elements than the bucket holds: counting them would cost what a peer chooses
            for seg in checked:
                _in_bucket(count[b], seg).add_(1)
            theirs[b] += printed
    if not all(bool((c == 1).all()) for c in count.values()):
        return None  # an element no rank holds, or one held twice
    same = all(math.isfinite(theirs[b]) and abs(theirs[b] - p) <= PRINT_TOLERANCE * m + 1e-30
               for b, (p, m, _) in mine.items())
    return [r["meta"] for r in replies], same
