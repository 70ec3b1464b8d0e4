"""The canonical layout: shards of any split map to the same buckets and back."""

from __future__ import annotations

import math

import pytest
import torch

from peers.island.layout import CanonicalLayout, Segment

PARAMS = [("emb", (10, 6)), ("wq", (6, 6)), ("wo", (6, 8)), ("norm", (6,)), ("w2", (5, 7)), ("scale", ()),
          ("head", (4, 3, 2))]


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PARAMS}


def canonical(layout: CanonicalLayout, full: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([full[p.name].reshape(-1) for p in layout.params])


def narrow(t: torch.Tensor, spec: tuple[int, int, int]) -> torch.Tensor:
    return t.reshape(1).narrow(*spec) if t.dim() == 0 else t.narrow(*spec).contiguous()


# two islands' ranks: tp=2 style (dims 0 and 1, replicated norm/scale) and pp=2 style (whole tensors)
TP2 = [
    {"emb": (0, 0, 5), "wq": (0, 0, 3), "wo": (1, 0, 4), "norm": (0, 0, 6), "w2": (1, 0, 4), "scale": (0, 0, 1),
     "head": (1, 0, 2)},
    {"emb": (0, 5, 5), "wq": (0, 3, 3), "wo": (1, 4, 4), "norm": (0, 0, 6), "w2": (1, 4, 3), "scale": (0, 0, 1),
     "head": (1, 2, 1)},
]
PP2 = [
    {"emb": (0, 0, 10), "wq": (0, 0, 6), "wo": (0, 0, 6)},
    {"norm": (0, 0, 6), "w2": (0, 0, 5), "scale": (0, 0, 1), "head": (2, 0, 2)},
]


def test_buckets_cover_the_canonical_space_and_span_parameters():
    layout = CanonicalLayout.build(PARAMS, 50)
    total = sum(math.prod(s) for _, s in PARAMS)
    assert layout.total_numel == total
    assert [(b.start, b.end) for b in layout.buckets] == [(s, min(s + 50, total)) for s in range(0, total, 50)]
    assert all(b.numel <= 50 for b in layout.buckets)
    # emb (60 elements) spans buckets 0 and 1; bucket 1 holds the end of emb and the start of wq
    assert layout.buckets_of("emb", (0, 0, 10)) == [0, 1]
    assert layout.buckets_of("wq", (0, 0, 6)) == [1]
    assert [layout.owner_of(b.index, 3) for b in layout.buckets] == [i % 3 for i in range(len(layout.buckets))]


@pytest.mark.parametrize("name,spec", [("emb", (0, 5, 5)), ("wo", (1, 2, 5)), ("head", (1, 1, 2)),
                                       ("head", (2, 1, 1)), ("scale", (0, 0, 1)), ("norm", (0, 2, 3))])
def test_local_ranges_and_round_trip(name, spec):
    layout = CanonicalLayout.build(PARAMS, 7)
    index = torch.arange(layout.total_numel, dtype=torch.float32)
    full = {p.name: index[p.start:p.end].reshape(p.shape) for p in layout.params}
    local = narrow(full[name], spec)
    ranges = layout.local_ranges(name, spec, tuple(local.shape))
    flat = local.reshape(-1)
    assert sum(n for _, _, n in ranges) == flat.numel()
    for c, lo, n in ranges:  # the local element at lo holds canonical index c
        assert torch.equal(flat[lo:lo + n], index[c:c + n])
    if spec[0] == 0:
        assert len(ranges) == 1  # a dim-0 shard is one contiguous range
    else:
        assert len(ranges) == math.prod(full[name].shape[:spec[0]])  # one per leading row
    # pack then unpack into zeros restores the shard exactly
    out = {name: torch.zeros_like(local)}
    for b in layout.buckets:
        values, mask = layout.pack(b, {name: local}, {name: spec})
        torch.testing.assert_close(values[mask], index[b.start:b.end][mask], rtol=0, atol=0)
        layout.unpack(b, index[b.start:b.end], out, {name: spec})
    assert torch.equal(out[name], local)


def test_two_shardings_pack_into_identical_buckets():
    layout = CanonicalLayout.build(PARAMS, 23)
    full = full_tensors()
    whole = canonical(layout, full)
    for split in (TP2, PP2):
        locals_ = [{n: narrow(full[n], s) for n, s in rank.items()} for rank in split]
        for b in layout.buckets:
            packed = [layout.pack(b, loc, rank) for loc, rank in zip(locals_, split)]
            total = sum(v for v, _ in packed)
            count = sum(m.int() for _, m in packed)
            assert bool((count >= 1).all()), "every element is held by some rank"
            torch.testing.assert_close(total / count, whole[b.start:b.end], rtol=0, atol=1e-7)
        # unpacking the canonical buckets gives every rank exactly its shards (replicas included)
        for loc, rank in zip(locals_, split):
            out = {n: torch.zeros_like(t) for n, t in loc.items()}
            for b in layout.buckets:
                layout.unpack(b, whole[b.start:b.end], out, rank)
            for n in loc:
                assert torch.equal(out[n], loc[n]), n


def test_replicated_shards_are_counted_by_the_mask():
    layout = CanonicalLayout.build(PARAMS, 1000)
    full = full_tensors()
    (b,) = layout.buckets
    masks = [layout.pack(b, {n: narrow(full[n], s) for n, s in rank.items()}, rank)[1] for rank in TP2]
    count = masks[0].int() + masks[1].int()
    norm = layout.entry("norm")
    assert bool((count[norm.start:norm.end] == 2).all())  # both TP ranks hold the norm
    emb = layout.entry("emb")
    assert bool((count[emb.start:emb.end] == 1).all())
    assert layout.is_full("norm", (0, 0, 6)) and not layout.is_full("emb", (0, 0, 5))


def test_dim1_segments_are_few_strided_blocks():
    layout = CanonicalLayout.build([("w", (1000, 512))], 100_000)
    segs = layout.segments("w", (1, 256, 256))
    assert sorted(segs) == list(range(len(layout.buckets)))
    assert all(len(s) <= 3 for s in segs.values())  # partial first row, full rows, partial last row
    block = max((s for ss in segs.values() for s in ss), key=lambda s: s.rows)
    assert isinstance(block, Segment) and block.row_len == 256 and block.row_stride == 512
    local = torch.randn(1000, 256)
    out = torch.zeros(1000, 256)
    for b in layout.buckets:
        values, mask = layout.pack(b, {"w": local}, {"w": (1, 256, 256)})
        layout.unpack(b, values, {"w": out}, {"w": (1, 256, 256)})
    assert torch.equal(out, local)


def test_fingerprints_differ_for_different_layouts():
    a = CanonicalLayout.build(PARAMS, 50)
    assert a.fingerprint() == CanonicalLayout.build(list(PARAMS), 50).fingerprint()
    assert a.fingerprint() != CanonicalLayout.build(PARAMS, 51).fingerprint()
    assert a.fingerprint() != CanonicalLayout.build(PARAMS[::-1], 50).fingerprint()
    renamed = [("embedding", (10, 6))] + PARAMS[1:]
    assert a.fingerprint() != CanonicalLayout.build(renamed, 50).fingerprint()
    reshaped = [("emb", (6, 10))] + PARAMS[1:]
    assert a.fingerprint() != CanonicalLayout.build(reshaped, 50).fingerprint()


def test_bad_shards_are_refused():
    layout = CanonicalLayout.build(PARAMS, 50)
    with pytest.raises(ValueError, match="does not fit"):
        layout.local_ranges("emb", (0, 8, 5))
    with pytest.raises(ValueError, match="implies"):
        layout.check_local("wo", (1, 0, 4), (6, 5))
    with pytest.raises(KeyError, match="not part of the canonical layout"):
        layout.segments("nope", (0, 0, 1))
    with pytest.raises(ValueError, match="appears twice"):
        CanonicalLayout.build([("a", (2,)), ("a", (3,))], 4)
