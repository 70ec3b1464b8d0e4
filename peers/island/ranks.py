"""What the peer node needs of the island's process group: who this rank is and the island's small control
collectives (the trainer's ``diloco.engine.runtime.Runtime`` is one)."""

from __future__ import annotations

from typing import Any, Protocol


class IslandRanks(Protocol):
    """This rank's place in its island (``dp * pp * tp`` processes, or one), and the island's control collectives:
    every decision the island's ranks take together goes through them."""

    global_rank: int
    """This process's rank in the torchrun world (0 for one process)."""
    island_index: int
    """Which island of the world this one is (several islands share a world under the torch backend)."""
    n_islands: int
    """Islands in the torchrun world (1 unless islands average with torch.distributed)."""
    group: Any
    """The island's process group (None for one process)."""
    world_ctrl: Any
    """A process group of the whole world for small host messages (gloo on GPUs; None for one process)."""
    timeout_s: float
    """The run's process-group timeout: every group made for the run takes it."""

    @property
    def rank(self) -> int:
        """This process's rank inside its island."""

    @property
    def is_main(self) -> bool:
        """Whether this is the island's rank 0 (it speaks for the island)."""

    def island_ranks(self) -> list[list[int]]:
        """Global ranks of every island of the world."""

    def bcast(self, obj: Any, world: bool = False) -> Any:
        """Rank 0's ``obj`` (of the island, or of the world) on every rank."""

    def gather_all(self, obj: Any, world: bool = False) -> list[Any]:
        """``obj`` of every rank of the island (or of the world), in rank order."""

    def reduce(self, values: list[float], op: str = "sum", world: bool = False) -> list[float]:
        """Element-wise sum or max of a few floats over the island (or the world)."""

    def raise_if_any(self, error: str, exc: type[Exception] = ..., world: bool = False) -> None:
        """Raise ``exc`` on every rank when any rank reports an error (so none is left waiting)."""
