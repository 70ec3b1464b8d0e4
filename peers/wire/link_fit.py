"""How long a round's bytes take on an island's link, fitted to the exchanges it measured: what each island
publishes with its pseudo-gradient under ``--averaging.compression auto``, so that every member of a group
predicts the same exchange time for each codec (see :func:`outer_optim.compression.choose_codec`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from peers.result import as_float


@dataclass
class LinkFit:
    """Seconds of an island's exchange ≈ ``latency + bytes × per_byte``, fitted to its last ``keep`` exchanges
    (the bytes it sent, over all its ranks, and the seconds the exchange took: waiting for the group's slowest
    member included, as the next round will).

    The latency is the intercept of a least-squares line through exchanges of two sizes or more (rounds of
    different codecs), at most half the fastest exchange; the rate is that of the *last* exchange once the
    latency is taken off, so that a link that slows down (or speeds up) is the one predicted from the very next
    round (a line through the last few exchanges alone, spanning both rates, predicted fp32 within budget right
    after a link dropped from 20 to 3 Mbit/s, and the round took 10.8 s).  While every exchange had about one
    size, the whole time is charged to the bytes (latency 0): larger payloads then look slower than they are, so
    the fit is not :meth:`separated` and ``auto`` tries the next codec up once to tell the two apart."""

    keep: int = 4
    samples: list[tuple[float, float]] = field(default_factory=list)

    def add(self, sent_bytes: float, seconds: float) -> None:
        """Remember one exchange (ignored unless both figures are positive and finite)."""
        if sent_bytes > 0 and seconds > 0 and math.isfinite(sent_bytes) and math.isfinite(seconds):
            self.samples = (self.samples + [(float(sent_bytes), float(seconds))])[-self.keep:]

    def separated(self) -> bool:
        """Whether the exchanges were of sizes different enough (1.5×) to tell latency from rate."""
        xs = [x for x, _ in self.samples]
        return bool(xs) and max(xs) >= 1.5 * min(xs)

    def fitted(self) -> tuple[float, float] | None:
        """(latency seconds, seconds per byte), or None before the first exchange."""
        if not self.samples:
            return None
        xs, ts = [x for x, _ in self.samples], [t for _, t in self.samples]
        latency = 0.0
        if self.separated():
            mx, mt = statistics.fmean(xs), statistics.fmean(ts)
            slope = sum((x - mx) * (t - mt) for x, t in self.samples) / sum((x - mx) ** 2 for x in xs)
            if slope > 0:
                latency = min(max(0.0, mt - slope * mx), 0.5 * min(ts))
        last_bytes, last_seconds = self.samples[-1]
        return latency, (last_seconds - latency) / last_bytes

    def published(self) -> dict[str, float]:
        """What the island tells the group (empty before its first exchange)."""
        fit = self.fitted()
        return {} if fit is None else {"latency": fit[0], "per_byte": fit[1], "separated": self.separated()}


def explore(links: Iterable[dict]) -> bool:
    """Whether some member's published link could not yet tell latency from rate (see :class:`LinkFit`)."""
    return any(link and not link.get("separated") for link in links)


def group_seconds(links: Iterable[dict], sent_bytes: float) -> float | None:
    """Seconds the slowest of the members' published links (:meth:`LinkFit.published`) takes to send
    ``sent_bytes``; None when a member has not measured its link yet."""
    worst = 0.0
    for link in links:
        latency, per_byte = as_float(link.get("latency")), as_float(link.get("per_byte"))
        if not (math.isfinite(latency) and math.isfinite(per_byte)):
            return None
        worst = max(worst, latency + per_byte * sent_bytes)
    return worst
