"""Outer optimizers of DiLoCo and pseudo-gradient handling."""

from outer_optim.outer import OuterOptimizer, checksum

__all__ = ["OuterOptimizer", "checksum"]
