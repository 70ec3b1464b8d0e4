"""The registry of wire formats: every value of ``--averaging.compression`` and what follows from each (which
drop part of Δ, which ``auto`` picks from, the docs' table).  The config's choices and checks, the peers and the
experiments all read it rather than list codecs of their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from outer_optim.compression.codec import Codec, reduce_scatters
from outer_optim.compression.dense import BlockAbsmaxCodec, FittedBlockCodec, Fp16Codec, Fp32Codec
from outer_optim.compression.sign import BlockSignCodec
from outer_optim.compression.topk import (
    TOPK_BITS,
    TOPK_CHUNK,
    TOPK_DEFAULT_BITS,
    TOPK_DEFAULT_DENSITY,
    TOPK_INDEX_BITS,
    TopKCodec,
    topk_problems,
)


@dataclass(frozen=True)
class CodecEntry:
    """One wire format of ``--averaging.compression``: the config's choices, its checks, the docs' table and
    the experiments all read :data:`REGISTRY`."""

    name: str
    travels: str
    """What goes on the wire, in a few words (the docs' table)."""
    build: Callable[[float, int], Codec]
    """``build(topk_density, topk_bits)``: the codec (only ``topk`` reads the two)."""
    auto: bool = True
    """Whether ``auto`` picks from it unless ``--averaging.auto_codecs`` says otherwise: every codec whose error its
    format fixes; not ``topk``, whose error depends on its density."""


REGISTRY: dict[str, CodecEntry] = {e.name: e for e in (
    CodecEntry("none", "fp32, the tensor's own bytes", lambda d, b: Fp32Codec()),
    CodecEntry("fp16", "IEEE half precision, clamped to ±65504", lambda d, b: Fp16Codec()),
    CodecEntry("int8", "blocks of 256 values: one fp32 absmax scale, int8 codes",
               lambda d, b: BlockAbsmaxCodec("int8", bits=8, block=256)),
    CodecEntry("int4", "blocks of 128 values: one fp32 absmax scale, 4-bit codes in [−7, 7] (symmetric "
                       "blockwise absmax, not E3M0)", lambda d, b: BlockAbsmaxCodec("int4", bits=4, block=128)),
    CodecEntry("int2", "blocks of 256 values: two bf16 magnitudes fitted to the block by least squares, and 2 bits "
                       "per value: its sign and the nearer magnitude", lambda d, b: FittedBlockCodec(block=256, bits=2)),
    CodecEntry("sign", "blocks of 256 values: one bf16 scale, the block's mean magnitude (the scale with the least "
                       "squared error for those signs), and 1 bit per value, its sign",
               lambda d, b: BlockSignCodec(block=256)),
    CodecEntry("topk", f"per chunk of {TOPK_CHUNK} values: the `--averaging.topk_density` largest entries, each a "
                       f"{TOPK_INDEX_BITS}-bit index plus `--averaging.topk_bits` ({' or '.join(map(str, TOPK_BITS))}) "
                       f"bits: a sign and one of 2^bits/2 magnitudes equally spaced from lo to hi, two bf16 per chunk "
                       f"fitted to the kept values by least squares",
               lambda d, b: TopKCodec(float(d), b), auto=False),
)}
"""Every wire format of pseudo-gradients, by name."""
CODECS = tuple(REGISTRY)
"""Every wire format's name (``--averaging.compression``)."""
LOSSY_CODECS = tuple(n for n, e in REGISTRY.items() if e.build(TOPK_DEFAULT_DENSITY, TOPK_DEFAULT_BITS).lossy)
"""The formats that drop part of Δ (what they drop can be carried into later rounds: error feedback)."""


AUTO = "auto"
"""``--averaging.compression auto``: each round, the group picks one of ``--averaging.auto_codecs`` from the link
it measured (:func:`outer_optim.compression.auto.choose_codec`)."""
AUTO_CODECS = tuple(n for n, e in REGISTRY.items() if e.auto)
"""What ``auto`` picks from by default, the most faithful first (the order of :data:`REGISTRY`; ``topk``, whose
error depends on its density, is left out unless named)."""
COMPRESSIONS = CODECS + (AUTO,)
"""Every value ``--averaging.compression`` takes: a codec, or ``auto``."""


def unknown_codec(name: str) -> str:
    """Why ``name`` is no value of ``--averaging.compression``, in one sentence naming those that exist ('' when it
    is one)."""
    if name in COMPRESSIONS:
        return ""
    return f"--averaging.compression {name} is not a codec; use one of {', '.join(COMPRESSIONS)}"


def may_drop(compression: str) -> bool:
    """Whether ``--averaging.compression compression`` may drop part of Δ in a round (a lossy codec, or ``auto``,
    which may pick one): what it drops can then be carried into later rounds (error feedback)."""
    return compression in LOSSY_CODECS or compression == AUTO


def make_codec(name: str, *, topk_density: float = TOPK_DEFAULT_DENSITY, topk_bits: int = TOPK_DEFAULT_BITS) -> Codec:
    """The codec called ``name`` (one of :data:`CODECS`); the topk settings are validated for every name
    (:func:`outer_optim.compression.topk.topk_problems`, as the config's checks do)."""
    if name not in REGISTRY:
        raise ValueError(unknown_codec(name) or f"--averaging.compression {name} picks one of the codecs each round "
                                                f"(choose_codec); make_codec takes one of {', '.join(CODECS)}")
    if problems := topk_problems(topk_density, topk_bits):
        raise ValueError(problems[0])
    return REGISTRY[name].build(topk_density, topk_bits)


def codec_table(numel: int = 1 << 20) -> str:
    """The docs' markdown table of every codec: what travels, bytes per value (at the default topk settings,
    measured on ``numel`` values) and how a group exchanges it."""
    rows = ["| codec | what travels | bytes per value | exchange |", "| --- | --- | ---: | --- |"]
    for name, entry in REGISTRY.items():
        codec = entry.build(TOPK_DEFAULT_DENSITY, TOPK_DEFAULT_BITS)
        if not reduce_scatters(codec, 3):
            exchange = "all-gather"
        elif reduce_scatters(codec, 2):
            exchange = "reduce-scatter"
        else:
            exchange = "all-gather at 2 members, reduce-scatter from 3"
        per_value = f"{codec.nbytes(numel) / numel:.3f}"
        if name == "topk":
            per_value += f" at {TOPK_DEFAULT_DENSITY:.0%}, {TOPK_DEFAULT_BITS} bits"
        rows.append(f"| `{name}`{' (default)' if name == 'none' else ''} | {entry.travels} | {per_value} | {exchange} |")
    return "\n".join(rows) + "\n"
