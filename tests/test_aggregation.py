"""The group's aggregation rules (:mod:`peers.aggregation`): ``mean`` keeps the exchange's bits, the robust
rules leave an honest round alone and hold one attacker of four to the honest members' own spread, NaN and Inf
stop at the member check, and every rule gives the same bits whatever torch's thread count."""

from __future__ import annotations

import math

import pytest
import torch

from peers.aggregation import (
    AGGREGATES,
    aggregate,
    bound_weights,
    member_norm_check,
    member_norms,
    outliers,
    sorting_network,
    spread,
    sum_of_squares,
    trim_count,
    weighted_mean,
)

ROBUST = [r for r in AGGREGATES if r != "mean"]
NUMEL = 10_000


def _honest(n: int, seed: int = 0, numel: int = NUMEL) -> dict[str, torch.Tensor]:
    """``n`` honest pseudo-gradients: a common direction plus noise of the same size (members of one run agree
    on the direction, and each carries its own noise)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    return {f"h{i}": common + torch.randn(numel, generator=g) for i in range(n)}


def _spread(honest: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """The honest members' mean and R, the largest distance of one of them to it (the distances below are in R)."""
    mean = weighted_mean(honest, {p: 1.0 for p in honest})
    return mean, max(float((v - mean).norm()) for v in honest.values())


def test_mean_keeps_the_bits_of_the_exchange():
    """``mean`` is Σ wᵢ·vᵢ / Σ wᵢ as the exchange has always computed it (a multiply then one fused multiply-add
    per member, in the order of the sorted ids): the same bits, so rounds keep their results."""
    values = _honest(4)
    weights = {"h0": 1.0, "h1": 3.0, "h2": 0.7, "h3": 1e-3}
    total = sum(weights[p] for p in sorted(values))
    expected = torch.mul(values["h0"], weights["h0"] / total)
    for p in ("h1", "h2", "h3"):
        expected.add_(values[p], alpha=weights[p] / total)
    out = torch.empty(NUMEL)
    assert aggregate(values, weights, "mean", out=out) is out
    assert torch.equal(out, expected)
    assert torch.equal(weighted_mean(values, weights), expected)


@pytest.mark.parametrize("rule", ROBUST)
def test_an_honest_round_is_left_alone(rule):
    """Nobody attacks: the clipped rules clip nobody at their default τ and return exactly the mean's bits (as
    they do as τ grows); CenteredClip at τ = 1 median distance clips about half the members and still lands
    within 2% of R of the mean; the trimmed mean of four (the middle two per coordinate) within 0.35 R."""
    values = _honest(4)
    weights = {p: 1.0 for p in values}
    mean, spread = _spread(values)
    if rule == "trimmed-mean":
        assert float((aggregate(values, weights, rule) - mean).norm()) < 0.35 * spread
        return
    assert torch.equal(aggregate(values, weights, rule), mean)
    assert torch.equal(aggregate(values, weights, rule, ratio=1e6), mean)
    if rule == "centered-clip":
        tight = aggregate(values, weights, rule, ratio=1.0)
        assert not torch.equal(tight, mean)  # it did clip
        assert float((tight - mean).norm()) < 0.02 * spread


ATTACKS = {
    "scaled ×1000": lambda h, g: 1000 * h,
    "sign-flipped ×1000": lambda h, g: -1000 * h,
    "sign-flipped": lambda h, g: -h,
    "random of honest norm": lambda h, g: torch.randn(h.numel(), generator=g) * (h.norm() / math.sqrt(h.numel())),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_one_attacker_of_four_stays_within_the_honest_spread(attack):
    """Three honest members and one attacker, equal weights.  Every robust rule stays within 1.25 R of the
    honest mean; a ×1000 attacker takes the plain mean hundreds of R away.  A lie of honest size (sign-flipped,
    random) cannot be told from an honest member by any rule: it moves even the mean by less than R, and the
    robust rules by no more than R (their guarantee is a bounded influence).  The clipped mean meets its own
    bound: the attacker moves it by at most wₐ/W·(τ + ‖honest mean‖)."""
    honest = _honest(3)
    mean, spread = _spread(honest)
    values = dict(honest, z=ATTACKS[attack](honest["h0"], torch.Generator().manual_seed(1)))
    weights = {p: 1.0 for p in values}
    big = "×1000" in attack
    plain = float((aggregate(values, weights, "mean") - mean).norm())
    assert plain > 100 * spread if big else plain < spread
    for rule in ROBUST:
        off = float((aggregate(values, weights, rule) - mean).norm())
        assert off < (1.25 if big else 1.0) * spread, rule
    norms = member_norms(values)
    tau = 2.0 * sorted(norms.values())[1]
    clipped = float((aggregate(values, weights, "clipped") - mean).norm())
    assert clipped <= 0.25 * (tau + float(mean.norm())) * (1 + 1e-5)
    assert member_norm_check(norms, 10.0) == (["z"] if big else [])


@pytest.mark.parametrize("rule", ROBUST)
def test_a_reversed_delta_inside_the_member_check_is_an_outlier_and_no_honest_member_ever_is(rule):
    """A member sending an honest member's Δ reversed × 4 passes the member check (10× the median norm) and is only
    clipped or trimmed: it is named an outlier of the aggregate, the evidence of a strike.  Honest members of 3 to
    8 are not, and of two members neither is (no majority tells which is far)."""
    honest = _honest(3)
    values = dict(honest, z=-4 * honest["h0"])
    weights = {p: 1.0 for p in values}
    assert member_norm_check(member_norms(values), 10.0) == []
    assert outliers(values, aggregate(values, weights, rule)) == ["z"]
    assert outliers(values, aggregate(values, weights, rule), ratio=0.0) == []
    for n in (3, 4, 8):
        group = _honest(n, seed=n)
        assert outliers(group, aggregate(group, {p: 1.0 for p in group}, rule)) == [], n
    pair = {"h0": honest["h0"], "z": values["z"]}
    assert outliers(pair, aggregate(pair, {p: 1.0 for p in pair}, rule)) == []


@pytest.mark.parametrize("rule", ROBUST)
def test_an_honest_member_trained_on_other_data_is_no_outlier(rule):
    """The false strike a clean run on ``tiny`` made: three honest islands within 0.3 norms of each other, a fourth,
    honest, on a shard unlike theirs, 1.1 to 2.2 norms away, 5.4 times their median distance to the aggregate.
    Measured in norms it stays under the ratio, and the same four with a reversed Δ × 4 beside them still name
    only the liar."""
    g = torch.Generator().manual_seed(3)
    common = torch.randn(NUMEL, generator=g)
    close = {f"h{i}": common + 0.15 * torch.randn(NUMEL, generator=g) for i in range(3)}
    apart = dict(close, far=0.6 * common + 1.6 * torch.randn(NUMEL, generator=g))
    weights = {p: 1.0 for p in apart}
    center = aggregate(apart, weights, rule)
    distances = {p: math.sqrt(sum_of_squares(v, center)) for p, v in apart.items()}
    if rule != "clipped":  # far by the old scale, the members' distances (the clipped mean sits nearer to it)
        assert distances["far"] > 5 * sorted(distances.values())[1]
    assert outliers(apart, center) == []
    liar = dict(apart, z=-4 * close["h0"])
    assert outliers(liar, aggregate(liar, dict(weights, z=1.0), rule)) == ["z"]
    # over 30 rounds of a clean run such an island drifted out past 2.9 norms (experiments/results/hostile-clean-30):
    # farther than the ratio, it is still no outlier, since it does not pull against the aggregate; a liar beside it is
    drifted = dict(close, far=0.6 * common + 4.0 * torch.randn(NUMEL, generator=g))
    center = aggregate(drifted, weights, rule)
    assert spread(drifted, center)["far"] > 3.0
    assert outliers(drifted, center) == []  # past the ratio, not pointing away
    liar = dict(drifted, z=-4 * close["h0"])
    assert outliers(liar, aggregate(liar, dict(weights, z=1.0), rule)) == ["z"]


def test_centered_clip_hands_over_the_distances_it_measured_to_its_result():
    """An honest round of ``centered-clip`` ends at its fixed point having measured every member's distance to its
    result: the outlier check takes those (a float64 pass over every member saved, 0.36 s at 4 × 40M) and they are
    the ones it would measure itself; a round that clipped someone hands over none."""
    honest = _honest(4)
    weights = {p: 1.0 for p in honest}
    measured: dict[str, float] = {}
    center = aggregate(honest, weights, "centered-clip", distances=measured)
    assert measured == {p: math.sqrt(sum_of_squares(v, center)) for p, v in honest.items()}
    clipped: dict[str, float] = {}
    aggregate(dict(honest, h0=honest["h0"] * 1000), weights, "centered-clip", distances=clipped)
    assert clipped == {}


def test_a_declared_weight_of_1e30_is_capped_under_tokens():
    """The attack of issue #63: one member declares 1e30 tokens and sends its Δ negated.  By the declared weights
    the mean *is* the attacker's Δ (pointing away from the honest mean); under ``tokens`` with a cap of twice
    an honest member's tokens it weighs 2 of 5, and every rule keeps the aggregate within 1.25 R of the
    honest mean and along it (the trimmed mean, which counts members not weights, within R)."""
    honest = _honest(3)
    mean, spread = _spread(honest)
    values = dict(honest, z=-honest["h0"])
    declared = {**{p: 1000.0 for p in honest}, "z": 1e30}
    steered = aggregate(values, declared, "mean")
    assert torch.nn.functional.cosine_similarity(steered, mean, dim=0) < 0
    assert float((steered - mean).norm()) > 2 * spread
    weights = bound_weights(declared, "tokens", cap=2000.0)
    assert weights == {"h0": 1000.0, "h1": 1000.0, "h2": 1000.0, "z": 2000.0}
    for rule in AGGREGATES:
        result = aggregate(values, weights, rule)
        assert torch.nn.functional.cosine_similarity(result, mean, dim=0) > 0.5, rule
        assert float((result - mean).norm()) < (1.0 if rule == "trimmed-mean" else 1.25) * spread, rule


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_members_stop_at_the_member_check(poison):
    """A member with a NaN or an infinity: the plain mean turns non-finite (the round's norm guard refuses it),
    the robust rules refuse to aggregate it (ValueError), and :func:`member_norm_check` names it; the group
    without it aggregates to finite values under every rule."""
    values = _honest(4)
    values["h3"] = values["h3"].clone()
    values["h3"][17] = poison
    weights = {p: 1.0 for p in values}
    assert not torch.isfinite(aggregate(values, weights, "mean")).all()
    for rule in ROBUST:
        with pytest.raises(ValueError, match="h3"):
            aggregate(values, weights, rule)
    rejected = member_norm_check(member_norms(values), 10.0)
    assert rejected == ["h3"]
    kept = {p: v for p, v in values.items() if p not in rejected}
    for rule in AGGREGATES:
        assert torch.isfinite(aggregate(kept, weights, rule)).all()


def test_a_member_of_weight_zero_does_not_count():
    """``tokens`` turns a weight that is not finite or not positive into 0, and a member of weight 0 is left out
    of every rule, even the plain mean (its values, NaN here, never reach the sum)."""
    assert bound_weights({"a": 5.0, "b": math.nan, "c": -1.0, "d": math.inf, "e": 0.0, "f": 9.0}, "tokens", 8.0) \
        == {"a": 5.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0, "f": 8.0}
    assert bound_weights({"a": 5.0, "b": 1e30}, "equal", 8.0) == {"a": 1.0, "b": 1.0}
    values = _honest(3)
    weights = {p: 1.0 for p in values}
    poisoned = dict(values, z=torch.full((NUMEL,), math.nan))
    for rule in AGGREGATES:
        assert torch.equal(aggregate(poisoned, dict(weights, z=0.0), rule), aggregate(values, weights, rule))


def test_the_member_check_uses_the_low_median():
    """The low median is a member's own norm.  Two members: it is the smaller norm, so a ×1000 member is caught
    at ratio 10 (the mean of the two would be above half the larger norm, and catch nothing at any ratio of 2 or
    more).  One member is never rejected for its size; a median of 0 rejects nobody for size; non-finite norms
    are rejected and left out of the median."""
    assert member_norm_check({"a": 1.0, "b": 1000.0}, 10.0) == ["b"]
    assert member_norm_check({"a": 1.0, "b": 9.0}, 10.0) == []
    assert member_norm_check({"a": 1e9}, 10.0) == []
    assert member_norm_check({"a": 1.0, "b": 1.1, "c": 1.2, "d": 11.2}, 10.0) == ["d"]  # median 1.1, not 1.15
    assert member_norm_check({"a": 1.0, "b": 1.1, "c": 1.2, "d": 10.9}, 10.0) == []
    assert member_norm_check({"a": 0.0, "b": 0.0, "c": 5.0}, 10.0) == []
    assert member_norm_check({"a": 1.0, "b": math.nan, "c": 1.0, "d": math.inf, "e": 20.0}, 10.0) == ["b", "d", "e"]
    assert member_norm_check({"a": 1.0, "b": math.nan, "c": 1e6}, 0.0) == ["b"]


def test_the_trimmed_mean_drops_at_least_one_from_three_members_on():
    """⌊0.25·n⌋ from each end, at least 1 from n = 3 (else one attacker of three stays in), leaving a value."""
    assert [trim_count(n) for n in range(1, 10)] == [0, 0, 1, 1, 1, 1, 1, 2, 2]
    assert trim_count(9, 0.45) == 4 and trim_count(4, 0.0) == 1
    values = {"a": torch.tensor([1.0, -5.0]), "b": torch.tensor([2.0, 0.0]), "c": torch.tensor([1e30, 7.0])}
    assert aggregate(values, dict.fromkeys(values, 1.0), "trimmed-mean").tolist() == [2.0, 0.0]


def test_the_sorting_network_sorts():
    """Every comparator sequence sorts all 0/1 inputs, hence (the 0-1 principle) all inputs."""
    for n in range(1, 13):
        network = sorting_network(n)
        for bits in range(1 << n):
            x = [(bits >> k) & 1 for k in range(n)]
            for i, j in network:
                x[i], x[j] = min(x[i], x[j]), max(x[i], x[j])
            assert x == sorted(x), n
    assert len(sorting_network(8)) == 19


@pytest.mark.parametrize("numel", [1, 1023, 1025, (1 << 18) + 3])
def test_sums_of_squares_are_exact_to_float64(numel):
    """The folded sum of squares agrees with the exactly rounded one to a few float64 ulps."""
    g = torch.Generator().manual_seed(numel)
    x, c = torch.randn(numel, generator=g) * 3, torch.randn(numel, generator=g)
    exact = math.fsum(v * v for v in x.double().tolist())
    assert sum_of_squares(x) == pytest.approx(exact, rel=1e-13)
    exact = math.fsum(v * v for v in (x.double() - c.double()).tolist())
    assert sum_of_squares(x, c) == pytest.approx(exact, rel=1e-13)


def _attacked_with_zeros(numel: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Four members, one of them ×1000 (so the clipped rules clip), unequal weights, and a stretch of zeros of
    both signs (the sign of a zero out of torch's minimum and maximum depends on their code path: at 3 threads,
    the values where the first thread's share of a block of 2¹⁸ ends take the scalar path)."""
    values = _honest(4, numel=numel)
    values["h3"] = values["h3"] * -1000
    for i, v in enumerate(values.values()):
        v[86_000:90_000] = 0.0 if i % 2 else -0.0  # across the end of a thread's share at 3 threads
    return values, {"h0": 1.0, "h1": 2.0, "h2": 1.5, "h3": 1.0}


def test_every_rule_gives_the_same_bits_whatever_the_thread_count():
    """What a member computes must not depend on its torch threads: ≥ 1M values per member, every rule, and the
    member norms, at 1 to 4 threads.  (A torch ``x.sum()`` of 1M fp32 gives three different values at 1, 2
    and 3 threads on the development machine: the rules never use a torch reduction for a value they keep.)"""
    values, weights = _attacked_with_zeros((1 << 20) + 7)
    threads = torch.get_num_threads()
    results: dict[int, tuple] = {}
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            results[n] = (member_norms(values), [aggregate(values, weights, rule) for rule in AGGREGATES])
    finally:
        torch.set_num_threads(threads)
    norms, first = results[1]
    for n in (2, 3, 4):
        assert results[n][0] == norms
        for rule, a, b in zip(AGGREGATES, first, results[n][1]):
            assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b)), (rule, n)


def test_mean_and_trimmed_mean_per_part_are_the_whole_bit_for_bit():
    """In a reduce-scatter each part's owner aggregates its part: ``mean`` and ``trimmed-mean`` work coordinate by
    coordinate, so the parts put together are the whole, bit for bit (the clipped rules per part are their
    blockwise variant, with norms of the part)."""
    numel = (1 << 19) + 11
    values, weights = _attacked_with_zeros(numel)
    cuts = [0, 100_003, 300_000, (1 << 18) + 5, numel]
    for rule in ("mean", "trimmed-mean"):
        whole = aggregate(values, weights, rule)
        parts = torch.empty(numel)
        for lo, hi in zip(cuts, cuts[1:]):
            aggregate({p: v[lo:hi] for p, v in values.items()}, weights, rule, out=parts[lo:hi])
        assert torch.equal(parts, whole), rule


@pytest.mark.parametrize("call, message", [
    (lambda v, w: aggregate(v, w, "median"), "not one of"),
    (lambda v, w: aggregate(v, w, "mean", ratio=2.0), "takes no parameter ratio"),
    (lambda v, w: aggregate(v, w, "clipped", ratio=0.0), "must be positive"),
    (lambda v, w: aggregate(v, w, "trimmed-mean", fraction=0.5), r"in \[0, 0.5\)"),
    (lambda v, w: aggregate(v, dict(w, h0=-1.0), "mean"), "not finite and non-negative"),
    (lambda v, w: aggregate(v, dict.fromkeys(w, 0.0), "mean"), "no member with a positive weight"),
    (lambda v, w: aggregate(dict(v, h0=v["h0"][:5]), w, "mean"), "one size"),
    (lambda v, w: bound_weights(w, "declared", 1.0), "not one of"),
    (lambda v, w: bound_weights(w, "tokens", math.inf), "finite and positive"),
])
def test_bad_arguments_are_named(call, message):
    values = _honest(3, numel=10)
    with pytest.raises(ValueError, match=message):
        call(values, {p: 1.0 for p in values})
