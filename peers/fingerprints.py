"""Fingerprints of averaged vectors and of θ_global: what the vote and the stale-member check compare.

A fingerprint is a short list of floats: per chunk of the flattened tensors, the sum, the sum of squares and
the count of its values.  Two peers holding the same values up to rounding produce fingerprints equal within
a small relative tolerance (the sums may be taken in another order on another machine); a vector with a part
left unaveraged, or NaN, does not.  A chunk's sums are taken piece by piece, in float32 (the vectorized
reductions: 2 ms for 16 MB on one core, where float64 sums of absolute values took 59 ms), without copying
the tensors into one.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

FINGERPRINT_CHUNKS = 64
CHUNKS_PER_BUCKET = 4
"""Fingerprint chunks per bucket of the canonical layout (12 floats per bucket): of a round's averaged buckets
in the vote, and of θ_global in canonical bucket order."""
STATS = 3
"""Floats per chunk: sum, sum of squares, count."""


def fingerprint(tensors: Sequence[torch.Tensor], chunks: int = FINGERPRINT_CHUNKS) -> list[float]:
    """Per-chunk (sum, sum of squares, count) of the flattened ``tensors``; chunks are cut as
    ``torch.tensor_split`` cuts the concatenation into ``chunks`` pieces."""
    return fingerprints([tensors], chunks)[0]


def fingerprints(groups: Sequence[Sequence[torch.Tensor]], chunks: int) -> list[list[float]]:
    """:func:`fingerprint` of each group of tensors, read back from their device at once: on a GPU, one
    synchronisation for all of them instead of two per chunk (a 1b θ_global: 300 buckets, 2,400 waits)."""
    plans, sums = [], []
    for tensors in groups:
        flats = [t.detach().reshape(-1) for t in tensors]
        total = sum(f.numel() for f in flats)
        cuts = [i * (total // chunks) + min(i, total % chunks) for i in range(chunks + 1)] if total else []
        plan: list[tuple[int, int, int]] = []  # per chunk: its first piece, its number of pieces, its count
        starts, pos = [], 0
        for f in flats:
            starts.append(pos)
            pos += f.numel()
        for lo, hi in zip(cuts, cuts[1:]):
            first = len(sums)
            for f, start in zip(flats, starts):
                a, b = max(lo, start), min(hi, start + f.numel())
                if a < b:
                    piece = f[a - start:b - start]
                    sums += [piece.sum(), torch.linalg.vector_norm(piece)]
            plan.append((first, (len(sums) - first) // 2, hi - lo))
        plans.append(plan)
    values = _read_back(sums)
    out = []
    for plan in plans:
        if not plan:
            out.append([0.0, 0.0, 0.0] * chunks)
            continue
        fp: list[float] = []
        for first, pieces, count in plan:
            s = sq = 0.0
            for i in range(first, first + 2 * pieces, 2):
                s += values[i]
                sq += values[i + 1] ** 2
            fp += [s, sq, float(count)]
        out.append(fp)
    return out


def _read_back(scalars: list[torch.Tensor]) -> list[float]:
    """Python floats of 0-d tensors, the same values as ``float(t)`` of each: one copy per device and dtype."""
    values: list[float] = [0.0] * len(scalars)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(scalars):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for index in groups.values():
        for i, v in zip(index, torch.stack([scalars[i] for i in index]).tolist()):
            values[i] = v
    return values


DIGEST_SLOTS = 8
"""Slots of a :func:`digest`: 24 floats whatever the model's size."""


def digest(fp: Sequence[float], slots: int = DIGEST_SLOTS) -> list[float]:
    """A fingerprint folded into ``slots`` chunks: chunk ``i``'s sum, sum of squares and count added into slot
    ``i % slots``.  What an island announces in the registry of the θ_global it holds (a 1b θ_global's full
    fingerprint is 3,600 floats, read by every island about once a second); two digests of the same values agree
    within the fingerprint's tolerance (:func:`fingerprints_agree`), a θ_global changed anywhere beyond rounding does
    not (a chunk's sum of squares moves its slot's)."""
    out = [0.0] * (STATS * slots)
    for i in range(0, len(fp) - len(fp) % STATS, STATS):
        slot = (i // STATS) % slots
        for k in range(STATS):
            out[STATS * slot + k] += float(fp[i + k])
    return out


def fingerprints_agree(a: Sequence[float], b: Sequence[float], rtol: float) -> bool:
    """True when two fingerprints are finite and equal within ``rtol`` of each chunk's magnitude: a chunk's
    sums of squares within ``rtol`` of each other, its sums within ``rtol`` of sqrt(count · sum of squares)
    (the largest its sum can be)."""
    if len(a) != len(b) or len(a) % STATS:
        return False
    for i in range(0, len(a), STATS):
        (sa, qa, na), (sb, qb, nb) = a[i:i + STATS], b[i:i + STATS]
        if not all(math.isfinite(x) for x in (sa, qa, na, sb, qb, nb)) or na != nb:
            return False
        if abs(qa - qb) > rtol * max(abs(qa), abs(qb)) + 1e-30:
            return False
        if abs(sa - sb) > rtol * math.sqrt(max(qa, qb, 0.0) * max(na, 1.0)) + 1e-30:
            return False
    return True


def majority_by_state(meta: dict[str, dict], me: str, rtol: float = 1e-5) -> tuple[list[str], bool]:
    """Split the group by agreeing ``state_fingerprint``; return (majority peers, am I outside it).

    The majority is the largest subset whose fingerprints agree and who descend from the same rounds (their
    ``lineage``, when they send one: the committed roster their θ_global came from); ties go to the subset holding
    the smallest peer id, so every member computes the same answer.  Members that sent no fingerprint agree with
    everybody.
    """
    peers = sorted(meta)
    prints = {p: meta[p].get("state_fingerprint") for p in peers}
    lineages = {p: meta[p].get("lineage") for p in peers}
    clusters: list[list[str]] = []
    for p in peers:
        if prints[p] is None:
            continue
        for cluster in clusters:
            first = cluster[0]
            same_lineage = lineages[first] is None or lineages[p] is None or lineages[first] == lineages[p]
            if same_lineage and fingerprints_agree(prints[first], prints[p], rtol):
                cluster.append(p)
                break
        else:
            clusters.append([p])
    if len(clusters) <= 1:
        return peers, False
    best = sorted(clusters, key=lambda c: (-len(c), min(c)))[0]
    best = best + [p for p in peers if prints[p] is None]
    return sorted(best), me not in best
