"""The outer optimizer of DiLoCo (:mod:`.outer`) and what it leans on: the guard against wild pseudo-gradients
(:mod:`.guard`), Streaming DiLoCo's fragments (:mod:`.fragments`), one-pass checks of whole tensors (:mod:`.tensors`)
and, as a sub-package of its own, :mod:`.compression`: the wire formats of pseudo-gradients, their registry, error
feedback and entropy coding."""

from outer_optim.outer import OuterOptimizer, checksum

__all__ = ["OuterOptimizer", "checksum"]
