"""Sign-and-magnitude levels fitted to values by least squares: ``int2``'s per block, ``topk``'s per chunk of kept
values.

A grid of M magnitudes m_j = lo + (hi-lo)*j/(M-1) (j < M) and a sign gives V = 2M levels; lo and hi are fitted to a
row's magnitudes by Lloyd iterations (each value to its nearest level, then lo and hi by linear regression) and
rounded to bfloat16, and each value takes its nearest level of the rounded grid.  (An absmax grid, levels at
s*(2i+1-V)/(V-1), puts top-k's kept values -- most of them just above the threshold -- on a level up to 3x too
large at 2 bits: 36% relative error on a real pseudo-gradient.)
"""

from __future__ import annotations

import torch

from outer_optim.compression.bitpack import from_le
from outer_optim.compression.codec import safe_divisor


def _grid_index(mag: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, m: int) -> torch.Tensor:
    """Index j < m of the level of the grid lo + (hi-lo)*j/(m-1) nearest each of ``mag`` (rows, k)."""
    step = safe_divisor(hi - lo)[:, None] / (m - 1)
    return torch.round((mag - lo[:, None]) / step).clamp_(0, m - 1)


def fit_grid(mag: torch.Tensor, m: int, iterations: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per row of ``mag`` (rows, k >= 1, non-negative): the grid of ``m`` >= 2 equally spaced
    levels from lo to hi that locally minimises the squared error of each row put on its nearest level.

    Lloyd iterations, each of which never raises the error: assign every value to its nearest level,
    then refit lo and hi by least squares on those assignments (a = lo*(1-u) + hi*u, u = j/(m-1)).
    """
    if m == 2:
        return _fit_two_levels(mag, iterations)
    mag = mag.to(torch.float64)
    lo, hi = mag.amin(dim=1), mag.amax(dim=1)
    mean = mag.mean(dim=1)
    for _ in range(iterations):
        u = _grid_index(mag, lo, hi, m) / (m - 1)
        s00, s01, s11 = ((1 - u) ** 2).sum(1), ((1 - u) * u).sum(1), (u * u).sum(1)
        b0, b1 = ((1 - u) * mag).sum(1), (u * mag).sum(1)
        det = s00 * s11 - s01 * s01
        # every value on one level (or k = 1): the grid collapses to their mean
        solvable = det > 1e-9 * (s00 + s11) ** 2
        safe = torch.where(solvable, det, torch.ones_like(det))
        lo = torch.where(solvable, (s11 * b0 - s01 * b1) / safe, mean).clamp_(min=0)
        hi = torch.maximum(torch.where(solvable, (s00 * b1 - s01 * b0) / safe, mean), lo)
    return lo.to(torch.float32), hi.to(torch.float32)


def _fit_two_levels(mag: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fit_grid` of two levels (``int2``, two-bit ``topk``): the same Lloyd iterations, whose least squares
    with every value on lo or on hi are the means of each side (2-means), in float32 sums of each row: three
    passes an iteration, where the general fit's float64 passes made ``int2`` encode 50x slower than ``int4``."""
    mag = mag.to(torch.float32)
    k = mag.shape[1]
    total = mag.sum(dim=1)
    lo, hi = mag.amin(dim=1), mag.amax(dim=1)
    mean = total / k
    for _ in range(iterations):
        # 1 where nearer hi (a tie goes to lo, as rounding half to even does); a float mask sums fastest
        upper = (mag > ((lo + hi) / 2)[:, None]).to(torch.float32)
        n_hi = upper.sum(dim=1)
        sum_hi = (mag * upper).sum(dim=1)
        both = (n_hi > 0) & (n_hi < k)  # else every value on one level: the grid collapses to their mean
        lo = torch.where(both, (total - sum_hi) / (k - n_hi).clamp(min=1), mean).clamp_(min=0)
        hi = torch.maximum(torch.where(both, sum_hi / n_hi.clamp(min=1), mean), lo)
    return lo, hi


class FittedLevels:
    """``bits``-bit codes of a sign and one of M = 2**bits/2 magnitudes equally spaced from lo to hi, lo and hi
    fitted to each row of values by least squares (:func:`fit_grid`) and rounded to bfloat16; code c < M decodes
    to -m_(M-1-c), code c >= M to +m_(c-M), so codes ascend with their values (``topk``'s kept values, ``int2``)."""

    def __init__(self, bits: int):
        self.bits = bits
        self.levels = 1 << bits
        self.magnitudes = self.levels // 2
        j = torch.arange(self.magnitudes, dtype=torch.float32)
        self._grid = torch.cat([j.flip(0), j]) / (self.magnitudes - 1)  # u of code c, c = 0 .. V-1
        self._sign = torch.cat([-torch.ones(self.magnitudes), torch.ones(self.magnitudes)])

    def level_values(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """(rows, V) float32: the value each code decodes to, for grids (lo, hi) of shape (rows,)."""
        return self._sign * (lo[:, None] + (hi - lo)[:, None] * self._grid)

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, 2) bfloat16 grids (lo, hi) and (rows, k) int32 codes of ``values`` (rows, k)."""
        grid = torch.stack(fit_grid(values.abs(), self.magnitudes), dim=1)
        grid = grid.clamp_(max=torch.finfo(torch.bfloat16).max).to(torch.bfloat16)
        lo, hi = grid.to(torch.float32).unbind(1)
        j = _grid_index(values.abs(), lo, hi, self.magnitudes).to(torch.int32)
        return grid, torch.where(values >= 0, self.magnitudes + j, self.magnitudes - 1 - j)

    def dequantize(self, grids: torch.Tensor, codes: torch.Tensor, what: str) -> torch.Tensor:
        """(rows, k) float32 values of ``codes`` (rows, k) on the little-endian bfloat16 ``grids`` (rows, 4 bytes);
        a grid that is not finite with 0 <= lo <= hi is refused, naming ``what`` was corrupt."""
        lo, hi = from_le(grids.reshape(-1, 2), torch.bfloat16).view(-1, 2).to(torch.float32).unbind(1)
        if not (bool(torch.isfinite(hi).all()) and bool((lo >= 0).all()) and bool((hi >= lo).all())):
            raise ValueError(f"corrupt {what} payload: a {'chunk' if what == 'topk' else 'block'}'s magnitudes "
                             f"must be finite with 0 <= lo <= hi")
        return self.level_values(lo, hi).gather(1, codes.long())
