"""The digest islands announce of the θ_global they hold: a fixed size whatever the model, equal for equal values up
to rounding, different for another θ_global."""

from __future__ import annotations

import torch

from peers.fingerprints import CHUNKS_PER_BUCKET, DIGEST_SLOTS, STATS, digest, fingerprint, fingerprints_agree


def _canonical(buckets: list[torch.Tensor]) -> list[float]:
    return [x for b in buckets for x in fingerprint([b], CHUNKS_PER_BUCKET)]


def test_a_digest_has_one_size_and_tells_states_apart():
    torch.manual_seed(0)
    theta = [torch.randn(1000) for _ in range(30)]
    mine = digest(_canonical(theta))
    assert len(mine) == STATS * DIGEST_SLOTS == len(digest(_canonical(theta[:3])))
    # the same values through another order of summation (another island's shape): equal within the tolerance
    again = digest(_canonical([t.flip(0).flip(0).clone() for t in theta]))
    assert fingerprints_agree(mine, again, 1e-5)
    rounded = digest(_canonical([t + t.abs() * 1e-7 for t in theta]))
    assert fingerprints_agree(mine, rounded, 1e-5)
    # a θ_global one round apart (every value moved a little), or one bucket replaced, is another one
    assert not fingerprints_agree(mine, digest(_canonical([t + 1e-2 * torch.randn(1000) for t in theta])), 1e-5)
    replaced = list(theta)
    replaced[7] = torch.randn(1000)
    assert not fingerprints_agree(mine, digest(_canonical(replaced)), 1e-5)
