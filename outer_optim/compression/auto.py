"""``--averaging.compression auto``: each round the group picks one codec from the link it measured, the same on
every member (:func:`choose_codec`); what it picks from by default is the registry's
(:data:`outer_optim.compression.registry.AUTO_CODECS`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from outer_optim.compression.codec import Codec, exchange_factor


def choose_codec(codecs: Mapping[str, Codec], numels: Sequence[int], group_size: int,
                 seconds_for: Callable[[float], float | None], budget: float, *, explore: bool = False) -> str:
    """``auto``'s pick for one round: the name of the first (most faithful) of ``codecs`` (by name, in order) whose
    bytes the link moves within ``budget`` seconds, ``seconds_for(bytes each member sends)`` telling how long the
    group's slowest member takes (None when some member has not measured its link yet).  The last (the fewest
    bytes) when none fits, the budget is unknown (NaN) or the link is.  ``explore``: the links' figures are pessimistic
    (they could not tell latency from rate yet), so take the next codec up from what they allow, whose exchange
    tells the two apart.  ``numels``: the round's buckets; a function of its arguments only, so every member
    given the same figures picks the same codec."""
    names = list(codecs)
    if not names:
        raise ValueError("auto needs at least one codec to pick from")
    if not budget == budget:
        return names[-1]
    fits = len(names) - 1
    for i, codec in enumerate(codecs.values()):
        seconds = seconds_for(sum(codec.nbytes(n) for n in numels) * exchange_factor(codec, group_size))
        if seconds is None:
            return names[-1]
        if seconds <= budget:
            fits = i
            break
    return names[max(0, fits - 1) if explore else fits]
