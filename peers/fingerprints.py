"""Fingerprints of averaged vectors and of θ_global: what the vote and the stale-member check compare.

A fingerprint is a short list of floats (per-chunk sums, absolute sums and square sums); two peers
holding the same values up to rounding produce fingerprints equal within a small relative tolerance.
"""

from __future__ import annotations

from typing import Sequence

import torch

FINGERPRINT_CHUNKS = 64


def fingerprint(tensors: Sequence[torch.Tensor], chunks: int = FINGERPRINT_CHUNKS) -> list[float]:
    """Per-chunk sums, absolute sums and square sums of the flattened tensors (float64).

    Two peers holding the same values up to rounding produce fingerprints equal within a small
    relative tolerance; a vector with a part left unaveraged or NaN does not.
    """
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]) if tensors else torch.zeros(1)
    out: list[float] = []
    for part in flat.tensor_split(chunks):
        out += [part.sum().item(), part.abs().sum().item(), part.pow(2).sum().item()]
    return out


def fingerprints_agree(a: Sequence[float], b: Sequence[float], rtol: float) -> bool:
    """True when two fingerprints are finite and equal within ``rtol`` of each chunk's magnitude."""
    if len(a) != len(b):
        return False
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if not (torch.isfinite(ta).all() and torch.isfinite(tb).all()):
        return False
    # per chunk (sum, abs-sum, square-sum): compare each to the chunk's own scale
    ta, tb = ta.view(-1, 3), tb.view(-1, 3)
    scale = torch.stack([ta[:, 1], ta[:, 1], ta[:, 2]], dim=1).abs() + 1e-30
    return bool(((ta - tb).abs() <= rtol * scale + 1e-12).all())



def majority_by_state(meta: dict[str, dict], me: str, rtol: float = 1e-5) -> tuple[list[str], bool]:
    """Split the group by agreeing ``state_fingerprint``; return (majority peers, am I outside it).

    The majority is the largest subset whose fingerprints agree; ties go to the subset holding the
    smallest peer id, so every member computes the same answer.  Members that sent no fingerprint
    agree with everybody.
    """
    peers = sorted(meta)
    prints = {p: meta[p].get("state_fingerprint") for p in peers}
    clusters: list[list[str]] = []
    for p in peers:
        if prints[p] is None:
            continue
        for cluster in clusters:
            if fingerprints_agree(prints[cluster[0]], prints[p], rtol):
                cluster.append(p)
                break
        else:
            clusters.append([p])
    if len(clusters) <= 1:
        return peers, False
    best = sorted(clusters, key=lambda c: (-len(c), min(c)))[0]
    best = best + [p for p in peers if prints[p] is None]
    return sorted(best), me not in best
