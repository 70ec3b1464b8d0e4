"""Streaming DiLoCo's fragments (Douillard et al. 2025): the model cut into groups of whole layers, each
averaged on its own staggered schedule, so one sync moves about 1/P of the model.

Fragment ``p`` of ``P`` holds a contiguous run of transformer blocks (``layers.<i>.*``), balanced by
block count; parameters before the first block (the token embedding) go with the first fragment and
parameters after the last block (final norm, output projection) with the last, as in the paper.
With ``P = 1`` the single fragment is the whole model: plain DiLoCo.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_BLOCK = re.compile(r"^layers\.(\d+)\.")


def split_into_fragments(names: Sequence[str], n_fragments: int) -> list[list[str]]:
    """``n_fragments`` lists of parameter names (in model order, together ``names``), each a run of whole
    blocks, with what precedes the blocks in the first and what follows them in the last."""
    if n_fragments < 1:
        raise ValueError(f"the number of fragments must be at least 1, got {n_fragments}")
    if n_fragments == 1:
        return [list(names)]
    blocks = sorted({int(m.group(1)) for n in names if (m := _BLOCK.match(n))})
    if len(blocks) < n_fragments:
        raise ValueError(f"cannot cut {len(blocks)} transformer blocks into {n_fragments} fragments of whole blocks")
    # block i goes to fragment floor(i * P / L): sizes differ by at most one
    fragment_of_block = {b: i * n_fragments // len(blocks) for i, b in enumerate(blocks)}
    out: list[list[str]] = [[] for _ in range(n_fragments)]
    seen_block = False
    for n in names:
        m = _BLOCK.match(n)
        if m:
            seen_block = True
            out[fragment_of_block[int(m.group(1))]].append(n)
        else:
            out[-1 if seen_block else 0].append(n)
    return out
