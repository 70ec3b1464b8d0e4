"""How a group's pseudo-gradients become one: the plain weighted mean and three rules robust to a member that
lies, with the weights members may declare and the check that rejects a member's vector before any rule runs.

Why robust rules.  A member holding the run key can otherwise steer θ_global alone: the weighted mean gives a
member whose declared weight is 1e30 the whole average, and a sign-flipped or ×1000 Δ from one member of four
moves the mean wherever it likes, while the outer optimizer's norm guard sees only the averaged norm.

The pieces, in the order a round uses them:

1. :func:`bound_weights`: the weight each member counts with.  ``equal`` (the default: every member 1) and
   ``tokens`` (the declared token count, clamped to a cap).
2. :func:`member_norms` and :func:`member_norm_check`: members whose vector is not finite, or whose norm is far
   above the group's median, are rejected before aggregation.  This is where NaN and Inf stop: the robust rules
   refuse a non-finite member (ValueError) rather than guess what it meant, and ``mean`` keeps what it always
   did (a non-finite member makes the average non-finite, which the round's norm guard then refuses).
3. :func:`aggregate` with one rule of :data:`AGGREGATES`:

   - ``mean``: Σ wᵢ·vᵢ / Σ wᵢ (:func:`weighted_mean`);
   - ``clipped``: each vector scaled down to norm at most τ = ``ratio`` × the median member norm, then the
     weighted mean (the sum still divided by Σ wᵢ, so a clipped member counts for less, not the others for more);
   - ``centered-clip``: CenteredClip (Karimireddy, He and Jaggi 2021; the aggregation of BTARD, Gorbunov et al.
     2022): from a start ``c``, ``iterations`` times c ← c + Σ wᵢ·min(1, τ/‖vᵢ − c‖)·(vᵢ − c) / Σ wᵢ, with
     τ = ``ratio`` × the median of the distances ‖vᵢ − c‖ at that iteration;
   - ``trimmed-mean``: per coordinate, the mean of the values left once the ``b`` largest and ``b`` smallest
     are dropped.

Medians.  Every median here is the *low* median: the ⌈n/2⌉-th smallest of n values, always one member's own
value (the mean of the two middle values would be no member's).  It matters at two members: their mean median
is at least half the larger norm, so no ratio of 2 or more ever rejects either (a ×1000 member of two is *not*
caught at ratio 10 by the mean of the two), while the low median is the smaller norm, which catches it.  Two
members have no majority, so no rule can tell which of them lies; the low median keeps the smaller step when
they differ by more than the ratio, which bounds the damage one member can do to ``ratio`` × the other's norm.

Defaults chosen so that an honest round is untouched: the islands of one run take the same number of inner
steps from the same θ_global on shards of one corpus, so their pseudo-gradients should have norms (and distances
to their mean) within tens of percent of each other (an expectation, not yet measured on real runs: each
island's ``pseudo_grad_norm`` in its metrics would tell), so at ``ratio`` 2 nobody is clipped, and ``clipped``
and ``centered-clip`` then return exactly the bits of ``mean``.  A member that attacks is cut to
τ, so it moves the aggregate by at most wₐ·τ / Σ wᵢ (``clipped``), or by about wₐ·τ / Σ_honest wᵢ at
CenteredClip's fixed point.

CenteredClip starts from the ``clipped`` mean, not the coordinate-wise median: the clipped mean is already
within wₐ·τ / Σ wᵢ of the honest one and costs one elementwise pass per member, while the coordinate-wise
median costs the sorting network of ``trimmed-mean`` and is noisier per coordinate on honest data (its first
iteration would have to undo that noise).  Three iterations by default: each one shrinks the start's pull
further, and the first already does most of it (Karimireddy et al. take one, from the previous aggregate).

The trimmed mean drops ``b = ⌊fraction·n⌋`` values from each end (``fraction`` 0.25 by default), and at least
one as soon as there are three members: the threat is one member (an island of the run with its key), and
⌊0.25·3⌋ = 0 would leave it in.  ``b`` is at most ⌊(n − 1)/2⌋ so that a value is left, and 0 for one or two
members (nothing to trim: the rule is then the unweighted mean).  It ignores the weights (the members it counts
all count 1): trimming by count bounds every coordinate of the result by the honest members' values whatever
the weights, and a weighted mean of the values left would have to carry each member's weight through the sort,
doubling the cost for a rule whose point is to not trust what members declare.  With ``equal`` weights (the
default) there is no difference.

A member whose weight is 0 does not count: it is left out of every rule (and of the medians).

Bit-identical on every member.  Every member that aggregates the same inputs gets the same bits, whatever its
torch thread count.  The thread count changes two things: how a torch reduction splits its sum (a ``x.sum()``
of 1M fp32 values gives three different results at 1, 2 and 3 threads), and where each thread's share of an
elementwise op ends, whose last values take the scalar path instead of the vector one.  So the work on the large
tensors is elementwise only, with ops that round the same on both paths (multiply, add, the fused multiply-add
of ``add_(alpha=)``, divide), and the norms that set the clip factors are sums of squares in float64 folded in a
fixed order (:func:`sum_of_squares`), never a torch reduction.  The factors are Python floats computed from those
norms, so every member scales by the same numbers.  The trimmed mean sorts with a fixed network of elementwise
minima and maxima, whose two paths disagree on the sign of a zero (min(-0, +0) is -0 on one, +0 on the other),
so its result gets + 0.0, which turns every -0 into +0.  ``tests/test_aggregation.py`` checks all of it on the
installed torch; members on different CPU families or torch builds may still differ (a fused multiply-add on
one and not the other), which is the vote's to catch, as it is for ``mean`` today.

Per part.  In a reduce-scatter each part's owner aggregates its part of every member's vector: a rule applied
per part is its blockwise variant (BTARD clips per part too), with norms, medians and τ of the part.  ``mean``
and ``trimmed-mean`` work coordinate by coordinate, so per part they give exactly the bits of the whole; the
clipped rules do not (a member may be clipped in one part and not another).

Costs (``benchmarks/aggregation_cost.py``, 8 members × 10M fp32 on 2 busy cores): ``mean`` about 20 ms; an
honest round ``clipped`` about 4×, ``centered-clip`` about 9× (the norms, then one pass of distances that finds
the mean a fixed point), ``trimmed-mean`` about 13×; with one member clipped, ``centered-clip`` about 25× (its
three iterations).  A float64 sum of squares costs 2 to 3 times a torch ``x.norm()``.  At 4 members × 40M on 2 cores: ``mean`` 61 ms, an
honest ``centered-clip`` 610 ms, and a whole robust round's aggregation (the member check's norms, the rule, the
outlier check on the distances the rule measured at its fixed point) 852 ms; measuring the distances again would
add 321 ms, what ``clipped`` and ``trimmed-mean`` pay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

AGGREGATES = ("mean", "clipped", "centered-clip", "trimmed-mean")
"""The rules of :func:`aggregate`."""
WEIGHTINGS = ("equal", "tokens")
"""The modes of :func:`bound_weights`."""

FOLD = 1 << 10
"""Partial sums a sum of squares keeps per position before they are added exactly (:func:`math.fsum`)."""
BLOCK = 1 << 17
"""Values taken at a time by the sums of squares and the trimmed mean (small enough to stay in cache)."""

CLIP_RATIO = 2.0
"""τ of the clipped rules, in medians (of the norms for ``clipped``, of the distances for ``centered-clip``)."""
ITERATIONS = 3
"""CenteredClip's iterations."""
TRIM_FRACTION = 0.25
"""The fraction of members the trimmed mean drops at each end, per coordinate."""
OUTLIER_RATIO = 3.0
"""How many times the group's median member norm a member's Δ may lie from the robust aggregate before it counts for
nothing and earns a strike (:func:`outliers`)."""


def bound_weights(declared: Mapping[str, float], mode: str, cap: float) -> dict[str, float]:
    """The weight each member counts with, from what it declared.

    ``equal``, the default of a run: every member 1.  A declared weight is a claim nobody can check, and it is
    the lever of the cheapest attack there is (declare 1e30 and own the average).  Honest islands of one run
    hardly need it: with a budget by steps they all stand for the same tokens, and with a budget by tokens or
    time each Δ is sent per million tokens (``send_scale`` of ``diloco.engine.rounds``), so the weights only
    re-weigh vectors of one scale.  With equal weights a member
    is at most one n-th of the group whatever it says.

    ``tokens``: the declared token count clamped into [0, ``cap``]; a weight that is not finite or not positive
    becomes 0, and a member of weight 0 does not count.  The cap bounds a liar's share of the group to
    ``cap`` / (``cap`` + the others' tokens)."""
    if mode == "equal":
        return {p: 1.0 for p in declared}
    if mode != "tokens":
        raise ValueError(f"weights mode {mode!r} is not one of {', '.join(WEIGHTINGS)}")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"weight cap {cap} must be finite and positive")
    out = {}
    for p, w in declared.items():
        w = float(w)
        out[p] = min(w, cap) if math.isfinite(w) and w > 0 else 0.0
    return out


def low_median(xs: list[float]) -> float:
    """The ⌈n/2⌉-th smallest of ``xs`` (a value of ``xs``, so the same on every member; see the module's
    docstring for why not the mean of the two middle values)."""
    return sorted(xs)[(len(xs) - 1) // 2]


def sum_of_squares(x: torch.Tensor, center: torch.Tensor | None = None) -> float:
    """Σ (xᵢ − centerᵢ)² of 1-D fp32 tensors in float64, the same bits whatever torch's thread count.

    Blocks of :data:`BLOCK` values are squared in float64 (exactly, for fp32 values) and folded in halves by
    elementwise adds down to :data:`FOLD` partial sums, added up block after block; :func:`math.fsum` then adds
    those exactly.  A torch reduction would split the sum by thread."""
    n = x.numel()
    if n == 0:
        return 0.0
    width = min(BLOCK, max(FOLD, 1 << (n - 1).bit_length()))
    buf = torch.empty(width, dtype=torch.float64)
    acc = torch.zeros(FOLD, dtype=torch.float64)
    for lo in range(0, n, width):
        m = min(width, n - lo)
        buf[:m].copy_(x[lo:lo + m])
        if center is not None:
            buf[:m].sub_(center[lo:lo + m])
        buf[m:].zero_()
        buf.mul_(buf)
        half = width
        while half > FOLD:
            half //= 2
            buf[:half].add_(buf[half:2 * half])
        acc.add_(buf[:FOLD])
    return math.fsum(acc.tolist())


def member_norms(values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """The L2 norm of each member's 1-D fp32 tensor (:func:`sum_of_squares`: the same bits on every member;
    infinite or NaN exactly when the tensor holds a value that is)."""
    return {p: math.sqrt(sum_of_squares(v)) for p, v in values.items()}


def member_norm_check(norms: Mapping[str, float], ratio: float) -> list[str]:
    """The members to reject (sorted): those whose norm is not finite, and those whose norm is above ``ratio``
    × the low median of the finite norms (see the module's docstring: with two members, the smaller norm).

    A median of 0 (half the members or more sent zeros) rejects nobody for its ratio, and neither does a
    ``ratio`` of 0 or less (only the finiteness check then)."""
    rejected = {p for p, x in norms.items() if not math.isfinite(x)}
    finite = [x for p, x in norms.items() if p not in rejected]
    if finite and ratio > 0:
        median = low_median(finite)
        if median > 0:
            rejected |= {p for p, x in norms.items() if p not in rejected and x > ratio * median}
    return sorted(rejected)


def outliers(values: Mapping[str, torch.Tensor], center: torch.Tensor, ratio: float = OUTLIER_RATIO,
             distances: Mapping[str, float] | None = None, norms: Mapping[str, float] | None = None) -> list[str]:
    """The members (sorted) whose vector lies farther from ``center`` (a robust aggregate of them) than ``ratio`` ×
    the low median of the members' norms *and* points away from it (an obtuse angle: the member pulls θ_global back
    along the aggregate): the evidence of a strike against a member that a robust rule only clipped or trimmed.
    None for fewer than three members (two have no majority to tell which of them is far), nor when ``ratio`` ≤ 0
    or the median norm is 0.

    Why: clipped to τ, a member sending its Δ reversed × 4 (inside the member check's 10× the median norm) still
    pulls θ_global τ away from the honest mean every round, and was never struck (``diloco experiment hostile`` on
    ``small``: the honest islands' held-out loss 7.9% above the clean run under ``centered-clip``).  It lies about 5
    median norms from the aggregate, pointing away from it.  The scale is the norm, not the members' median distance
    to the aggregate: on ``tiny`` three honest islands sat within 0.3 norms of each other and a fourth, honest too,
    1.1 to 2 norms from them, 5.4 times their median distance (struck out of a clean run, in 2 of 10 rounds, by a
    ratio of 4 medians of the distances).  The angle: over 30 rounds of a clean run that fourth island drifted out
    to 2.45 norms under ``centered-clip`` and 2.94 under ``trimmed-mean``, past 3 soon after
    (``experiments/results/hostile-clean-30``), while still pulling the way the aggregate does.  Distances and
    norms are :func:`sum_of_squares` in float64, and the angle comes from them: every member strikes alike;
    ``distances``: the members' distances to ``center`` when the rule measured them already (:func:`aggregate`'s
    ``distances``), ``norms`` their norms when the member check did (:func:`member_norms`)."""
    if ratio <= 0:
        return []
    measured = _measured(values, center, distances, norms)
    if measured is None:
        return []
    distances, norms, scale = measured
    far = [p for p in values if distances[p] > ratio * scale]
    if not far:  # the angle's pass over the aggregate only for a member that is far
        return []
    center_sq = sum_of_squares(center)
    return sorted(p for p in far if distances[p] ** 2 > norms[p] ** 2 + center_sq)


def spread(values: Mapping[str, torch.Tensor], center: torch.Tensor, distances: Mapping[str, float] | None = None,
           norms: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each member's distance to ``center`` in the low median of the members' norms: what :func:`outliers` compares
    with its ratio (``distances`` and ``norms`` as there).  Empty for fewer than three members or a median norm
    of 0."""
    measured = _measured(values, center, distances, norms)
    if measured is None:
        return {}
    distances, _, scale = measured
    return {p: distances[p] / scale for p in values}


def _measured(values: Mapping[str, torch.Tensor], center: torch.Tensor, distances: Mapping[str, float] | None,
              norms: Mapping[str, float] | None) -> tuple[Mapping[str, float], Mapping[str, float], float] | None:
    """The members' distances to ``center``, their norms and the low median of the norms (each taken as given when
    it covers every member), or None for fewer than three members or a median norm of 0."""
    if len(values) < 3:
        return None
    if distances is None or set(distances) != set(values):
        distances = {p: math.sqrt(sum_of_squares(v, center)) for p, v in values.items()}
    if norms is None or not set(values) <= set(norms):
        norms = member_norms(values)
    scale = low_median([norms[p] for p in values])
    return (distances, norms, scale) if scale > 0 else None


def weighted_mean(values: dict[str, torch.Tensor], weights: dict[str, float], out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Σ wᵢ·vᵢ / Σ wᵢ in fp32, summed in the order of the sorted member ids: the same bits on every member
    (written into ``out`` when given)."""
    order = sorted(values)
    total = sum(weights[p] for p in order)
    return _combine(values, {p: weights[p] / total for p in order}, out)


def _combine(values: Mapping[str, torch.Tensor], coefs: Mapping[str, float], out: torch.Tensor | None,
             base: torch.Tensor | None = None, base_coef: float = 0.0) -> torch.Tensor:
    """Σ coefᵢ·vᵢ (+ ``base_coef``·``base``, ``base`` not ``out``), one elementwise multiply-add per member in
    the order of the sorted member ids."""
    order = sorted(values)
    out = torch.mul(values[order[0]].float(), coefs[order[0]], out=out)
    for p in order[1:]:
        out.add_(values[p], alpha=coefs[p])
    if base is not None and base_coef:
        out.add_(base, alpha=base_coef)
    return out


def _clip_factors(distances: Mapping[str, float], ratio: float) -> dict[str, float]:
    """min(1, τ/dᵢ) with τ = ``ratio`` × the low median of the distances (exactly 1 for a distance within τ, so
    that a member within reach is not scaled at all)."""
    tau = ratio * low_median(list(distances.values()))
    return {p: 1.0 if d <= tau else tau / d for p, d in distances.items()}


def _clipped_mean(values: Mapping[str, torch.Tensor], weights: Mapping[str, float], scale: Mapping[str, float],
                  out: torch.Tensor | None, center: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted mean of the members pulled towards ``center`` (0 when None) by the factors ``scale``:
    Σ (wᵢ·sᵢ/W)·vᵢ + (1 − Σ wᵢ·sᵢ/W)·center, which is center + Σ wᵢ·sᵢ·(vᵢ − center)/W written with
    non-negative factors only (no cancellation).  With every factor 1, the center's factor is exactly 0 and
    the rest is ``mean``'s combination: the same bits."""
    order = sorted(values)
    total = sum(weights[p] for p in order)
    kept = sum(weights[p] * scale[p] for p in order)
    return _combine(values, {p: weights[p] * scale[p] / total for p in order}, out, center,
                    (total - kept) / total if center is not None else 0.0)


def _centered_clip(values: Mapping[str, torch.Tensor], weights: Mapping[str, float], out: torch.Tensor | None,
                   norms: Mapping[str, float], ratio: float, iterations: int,
                   distances: dict[str, float] | None = None) -> torch.Tensor:
    """CenteredClip from the clipped mean.  An iteration that clips nobody from a center that is already the
    mean gives the mean again, bit for bit: the iterations stop there, so an honest round costs one pass of
    distances, not ``iterations``; those are the members' distances to the result, written into ``distances``."""
    numel = values[next(iter(values))].numel()
    result = out if out is not None else torch.empty(numel)
    center, target = result, torch.empty(numel)
    scale = _clip_factors(norms, ratio)
    _clipped_mean(values, weights, scale, center)
    for _ in range(iterations):
        was_mean = all(f == 1.0 for f in scale.values())
        measured = {p: math.sqrt(sum_of_squares(v, center)) for p, v in values.items()}
        scale = _clip_factors(measured, ratio)
        if was_mean and all(f == 1.0 for f in scale.values()):
            if distances is not None:
                distances.update(measured)
            break
        _clipped_mean(values, weights, scale, target, center)
        center, target = target, center
    if center is not result:
        result.copy_(center)
    return result


def trim_count(n: int, fraction: float = TRIM_FRACTION) -> int:
    """How many values the trimmed mean drops at each end of ``n``: ⌊``fraction``·n⌋, at least 1 from three
    members on, at most ⌊(n − 1)/2⌋ (see the module's docstring)."""
    if not 0 <= fraction < 0.5:
        raise ValueError(f"trimmed-mean fraction {fraction} must be in [0, 0.5)")
    b = max(int(fraction * n), 1 if n >= 3 else 0)
    return min(b, (n - 1) // 2)


def sorting_network(n: int) -> list[tuple[int, int]]:
    """Comparators (i, j), i < j, that sort any ``n`` values when each puts the smaller at i: Batcher's
    merge exchange (Knuth, TAOCP 5.2.2, algorithm M), 19 comparators for 8 values."""
    pairs: list[tuple[int, int]] = []
    if n < 2:
        return pairs
    t = (n - 1).bit_length()
    p = 1 << (t - 1)
    while p > 0:
        q, r, d = 1 << (t - 1), 0, p
        while True:
            pairs.extend((i, i + d) for i in range(n - d) if i & p == r)
            if q == p:
                break
            d, q, r = q - p, q // 2, p
        p //= 2
    return pairs


def _trimmed_mean(values: Mapping[str, torch.Tensor], out: torch.Tensor | None, fraction: float) -> torch.Tensor:
    order = sorted(values)
    n, numel = len(order), values[order[0]].numel()
    b = trim_count(n, fraction)
    keep = n - 2 * b
    out = out if out is not None else torch.empty(numel)
    network = sorting_network(n)
    width = min(BLOCK, max(numel, 1))
    bufs = [torch.empty(width) for _ in range(n + 1)]  # a row per member and one spare
    for lo in range(0, numel, width):
        m = min(width, numel - lo)
        rows = [buf[:m] for buf in bufs]
        for row, p in zip(rows, order):
            row.copy_(values[p][lo:lo + m])
        free = rows.pop()
        for i, j in network:  # the minimum goes to the spare row, which then takes i's place
            torch.minimum(rows[i], rows[j], out=free)
            torch.maximum(rows[i], rows[j], out=rows[j])
            rows[i], free = free, rows[i]
        dest = out[lo:lo + m]
        dest.copy_(rows[b])
        for row in rows[b + 1:b + keep]:
            dest.add_(row)
        if keep > 1:
            dest.div_(keep)
        dest.add_(0.0)  # -0 → +0: the sign of a zero may depend on which path of the minimum took it
    return out


PARAMS = {"mean": (), "clipped": ("ratio",), "centered-clip": ("ratio", "iterations"), "trimmed-mean": ("fraction",)}
"""The keyword parameters each rule of :func:`aggregate` takes."""


def aggregate(values: dict[str, torch.Tensor], weights: dict[str, float], rule: str,
              out: torch.Tensor | None = None, distances: dict[str, float] | None = None,
              **params: float) -> torch.Tensor:
    """The ``rule`` aggregate of the members' 1-D fp32 tensors (the same numel), by the weights of
    :func:`bound_weights`; written into ``out`` when given (not one of ``values``).  The same bits on every
    member that aggregates the same inputs (see the module's docstring).

    Members of weight 0 do not count.  The robust rules refuse a member whose values are not finite
    (ValueError): run :func:`member_norm_check` first and leave out whom it rejects.  Parameters:
    ``clipped``: ``ratio`` (τ in median norms, :data:`CLIP_RATIO`); ``centered-clip``: ``ratio`` (τ in median
    distances) and ``iterations`` (:data:`ITERATIONS`); ``trimmed-mean``: ``fraction`` (:data:`TRIM_FRACTION`).
    ``distances``: filled with the counted members' distances to the result when the rule measured them on the way
    (``centered-clip`` at its fixed point), for :func:`outliers`; left as it is otherwise."""
    if rule not in AGGREGATES:
        raise ValueError(f"aggregation rule {rule!r} is not one of {', '.join(AGGREGATES)}")
    unknown = sorted(set(params) - set(PARAMS[rule]))
    if unknown:
        raise ValueError(f"aggregation rule {rule!r} takes no parameter {', '.join(unknown)} "
                         f"(it takes: {', '.join(PARAMS[rule]) or 'none'})")
    bad = sorted(p for p in values if not (math.isfinite(weights[p]) and weights[p] >= 0))
    if bad:
        raise ValueError(f"members {bad} have weights that are not finite and non-negative: bound them first")
    counted = {p: v for p, v in values.items() if weights[p] > 0}
    if not counted:
        raise ValueError("no member with a positive weight to aggregate")
    sizes = {v.numel() for v in counted.values()}
    if len(sizes) > 1 or any(v.dim() != 1 or v.dtype != torch.float32 for v in counted.values()):
        raise ValueError("aggregate takes 1-D fp32 tensors of one size from every member")
    if rule == "mean":
        return weighted_mean(counted, weights, out)
    if rule == "trimmed-mean":
        unfinite = sorted(p for p, v in counted.items() if not math.isfinite(float(v.sum(dtype=torch.float64))))
        norms = None
    else:
        norms = member_norms(counted)
        unfinite = sorted(p for p, x in norms.items() if not math.isfinite(x))
    if unfinite:
        raise ValueError(f"members {unfinite} sent values that are not finite: reject them before aggregating "
                         "(member_norm_check)")
    if rule == "trimmed-mean":
        return _trimmed_mean(counted, out, float(params.get("fraction", TRIM_FRACTION)))
    ratio = float(params.get("ratio", CLIP_RATIO))
    if not ratio > 0:
        raise ValueError(f"clip ratio {ratio} must be positive")
    if rule == "clipped":
        return _clipped_mean(counted, weights, _clip_factors(norms, ratio), out)
    iterations = int(params.get("iterations", ITERATIONS))
    if iterations < 1:
        raise ValueError(f"centered-clip iterations {iterations} must be at least 1")
    return _centered_clip(counted, weights, out, norms, ratio, iterations, distances)
