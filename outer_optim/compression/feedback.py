"""Error feedback (SparseLoCo / EF21-style): what a lossy codec drops from Δ in one round is carried into the
next, rather than lost; and the bound of its decay β, which the config's checks read too."""

from __future__ import annotations

import torch

from outer_optim.compression.codec import Codec


def decay_problem(decay: float) -> str:
    """Why ``decay`` is no decay β of the error feedback (``--averaging.error_feedback_decay``), in one sentence;
    '' when it is one: β in (0, 1].  The config's checks and :class:`ErrorFeedback` both ask here."""
    if not (isinstance(decay, (int, float)) and 0 < decay <= 1):
        return f"--averaging.error_feedback_decay must be in (0, 1], got {decay!r}"
    return ""


class ErrorFeedback:
    """Per-bucket error-feedback buffer e (SparseLoCo / EF21-style).

    Each round: e <- decay*e + delta; send q = codec(e); e <- e - decode(q).  What the codec drops is
    kept in e and sent in later rounds instead of being lost.
    """

    def __init__(self, codec: Codec, decay: float = 1.0):
        if problem := decay_problem(decay):
            raise ValueError(problem)
        self.codec, self.decay = codec, float(decay)

    def prepare(self, delta: torch.Tensor, buffer: torch.Tensor | None
                ) -> tuple[bytes, torch.Tensor, torch.Tensor]:
        """(payload, sent, new_buffer) for one round; leaves ``delta`` and ``buffer`` untouched.

        The caller commits ``new_buffer`` only if the round commits, so a failed round loses nothing.
        """
        if buffer is None:
            residual = delta  # read only: encoded, then subtracted from
        elif buffer.shape != delta.shape:
            raise ValueError(f"error-feedback buffer of shape {tuple(buffer.shape)} does not match "
                             f"the delta's {tuple(delta.shape)}")
        else:
            residual = buffer * self.decay + delta
        if hasattr(self.codec, "encode_and_decode"):
            payload, sent = self.codec.encode_and_decode(residual)
        else:
            payload = self.codec.encode(residual)
            sent = self.codec.decode(payload, residual.numel())
        return payload, sent, residual - sent
