"""Compression of pseudo-gradients (pure math: no networking, CPU float32 only): every wire format of
``--averaging.compression``, the registry they are chosen from, error feedback for what they drop, and the entropy
coding of their payloads on the wire.

Every codec maps a 1-D float32 tensor of N values to a payload whose size depends only on N.  All multi-byte
numbers are little-endian; bit streams are LSB-first (bit j of the stream is bit j % 8 of byte j // 8) and each
stream is padded with zero bits to a whole byte.  Decoding is elementwise (no reductions), so the same payload gives
bit-identical tensors everywhere.

- :mod:`.codec`: the :class:`Codec` protocol, the checks every codec makes, and how a group exchanges payloads;
- :mod:`.registry`: every codec by name, what ``auto`` picks from, :func:`make_codec`;
- the formats: :mod:`.dense` (``none``, ``fp16``, ``int8``, ``int4``, ``int2``), :mod:`.sign`, :mod:`.topk`,
  on :mod:`.levels` (grids fitted by least squares: ``int2`` and ``topk``) and :mod:`.bitpack` (bytes and bit
  streams);
- :mod:`.feedback`: error feedback, which carries what a lossy codec dropped into later rounds;
- :mod:`.auto`: ``auto``'s pick of a codec each round, from the link the group measured;
- :mod:`.entropy`: Huffman coding of a payload on the wire (``--averaging.entropy_coding``).

The config's checks and the codecs read the same bounds (:func:`.topk.topk_problems`,
:func:`.feedback.decay_problem`) and the same lists (:data:`CODECS`, :data:`AUTO_CODECS`), each stated once.
"""

from outer_optim.compression.auto import choose_codec
from outer_optim.compression.codec import Codec, Payload, exchange_factor, is_dense, reduce_scatters, wire_ratio
from outer_optim.compression.feedback import ErrorFeedback, decay_problem
from outer_optim.compression.registry import (
    AUTO,
    AUTO_CODECS,
    CODECS,
    COMPRESSIONS,
    LOSSY_CODECS,
    REGISTRY,
    CodecEntry,
    codec_table,
    make_codec,
    may_drop,
    unknown_codec,
)
from outer_optim.compression.topk import TOPK_BITS, TOPK_DEFAULT_BITS, TOPK_DEFAULT_DENSITY, topk_problems

__all__ = [
    "AUTO", "AUTO_CODECS", "CODECS", "COMPRESSIONS", "LOSSY_CODECS", "REGISTRY", "TOPK_BITS", "TOPK_DEFAULT_BITS",
    "TOPK_DEFAULT_DENSITY", "Codec", "CodecEntry", "ErrorFeedback", "Payload", "choose_codec", "codec_table",
    "decay_problem", "exchange_factor", "is_dense", "make_codec", "may_drop", "reduce_scatters", "topk_problems",
    "unknown_codec", "wire_ratio",
]
