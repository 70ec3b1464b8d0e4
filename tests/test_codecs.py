"""Low-bit pseudo-gradient codecs: wire formats, error bounds, sizes, determinism and error feedback."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from outer_optim.compression.bitpack import pack_bits, unpack_bits
from outer_optim.compression import LOSSY_CODECS, ErrorFeedback, make_codec, wire_ratio

SIZES = (1, 7, 255, 256, 257, 4095, 4096, 4097, 10000)
CODEC_SETTINGS = [("int8", {}), ("int4", {}), ("int2", {}), ("sign", {})] + [
    ("topk", {"topk_density": d, "topk_bits": b}) for d in (0.01, 1.0) for b in (2, 4)]


def randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ---- reference decoders written straight from the format description, one value at a time -------

def parse_block(payload: bytes, n: int, bits: int, block: int) -> tuple[list[float], list[int]]:
    """(scales, integer codes q) of an int8 / int4 payload."""
    nblocks = -(-n // block)
    scales = list(struct.unpack_from(f"<{nblocks}f", payload, 0))
    body = payload[4 * nblocks:]
    if bits == 8:
        codes = list(struct.unpack(f"<{n}b", body))
    else:
        codes = [((byte >> shift) & 15) - 8 for byte in body for shift in (0, 4)][:n]
    return scales, codes


def bf16(raw: int) -> float:
    return struct.unpack("<f", struct.pack("<I", raw << 16))[0]


def parse_topk(payload: bytes, n: int, density: float,
               bits: int) -> list[tuple[int, int, tuple[float, float], list[tuple[int, int]]]]:
    """Per chunk: (start, length, (lo, hi), [(index, code), ...])."""
    chunks, offset = [], 0
    for start in range(0, n, 4096):
        length = min(4096, n - start)
        k = max(1, min(length, math.floor(density * length + 0.5)))
        lo, hi = (bf16(v) for v in struct.unpack_from("<2H", payload, offset))
        size = (k * (12 + bits) + 7) // 8
        stream = int.from_bytes(payload[offset + 4:offset + 4 + size], "little")
        records = [(stream >> (j * (12 + bits))) & ((1 << (12 + bits)) - 1) for j in range(k)]
        chunks.append((start, length, (lo, hi), [(r & 4095, r >> 12) for r in records]))
        offset += 4 + size
    assert offset == len(payload)
    return chunks


# ---- hand-computed payloads pin the wire formats ---------------------------------------------------

def test_int8_payload_by_hand():
    x = torch.tensor([0.0, 127.0, -254.0])  # s = 2; 63.5 rounds half to even
    payload = make_codec("int8").encode(x)
    assert payload == struct.pack("<f", 2.0) + bytes([0, 64, 256 - 127])
    assert make_codec("int8").decode(payload, 3).tolist() == [0.0, 128.0, -254.0]


def test_int4_payload_by_hand():
    x = torch.tensor([7.0, -7.0, 3.5])  # s = 1; q = 7, -7, 4 -> nibbles 15, 1, 12 and one pad nibble
    payload = make_codec("int4").encode(x)
    assert payload == struct.pack("<f", 1.0) + bytes([0x1F, 0x0C])
    assert make_codec("int4").decode(payload, 3).tolist() == [7.0, -7.0, 4.0]


def test_sign_payload_by_hand():
    x = torch.tensor([1.0, -3.0, 0.0, 2.0])  # one short block: s = mean |x| = 1.5; x >= 0 -> bit 1
    payload = make_codec("sign").encode(x)
    assert payload == struct.pack("<H", 0x3FC0) + bytes([0b1101])  # bf16 1.5
    assert make_codec("sign").decode(payload, 4).tolist() == [1.5, -1.5, 1.5, 1.5]


def test_sign_keeps_every_sign_at_the_best_scale_of_each_block():
    n = 3 * 256 + 40
    x = randn(n, seed=4) * torch.linspace(0.01, 50.0, n)
    decoded = make_codec("sign").decode(make_codec("sign").encode(x), n)
    assert torch.equal(decoded >= 0, x >= 0)
    for start in range(0, n, 256):
        part, got = x[start:start + 256], decoded[start:start + 256]
        assert got.abs().unique().numel() == 1
        best = part.abs().mean()  # minimises |part - s*sign(part)|^2 over s
        assert float(got.abs()[0]) == pytest.approx(float(best), rel=2 ** -8)  # bfloat16 rounding
        assert float((part - got).norm()) <= float((part - got.abs()[0] * 1.01 * part.sign()).norm())


def topk_level(lo: float, hi: float, code: int, bits: int) -> torch.Tensor:
    """What ``code`` decodes to on the grid (lo, hi), as the module docstring says, in float32."""
    m = 2 ** bits // 2
    j = code - m if code >= m else m - 1 - code
    u = torch.tensor(float(j), dtype=torch.float32) / (m - 1)
    lo32, hi32 = torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32)
    return (1.0 if code >= m else -1.0) * (lo32 + (hi32 - lo32) * u)


def test_topk_payload_by_hand():
    codec = make_codec("topk", topk_density=0.5, topk_bits=2)  # k = 2 of 4: magnitudes 1 and 2 fit lo=1, hi=2
    payload = codec.encode(torch.tensor([0.5, -2.0, 1.0, 0.0]))
    records = (1 | 0 << 12) | (2 | 2 << 12) << 14  # (index 1, code 0: -hi), (index 2, code 2: +lo)
    assert payload == struct.pack("<2H", 0x3F80, 0x4000) + records.to_bytes(4, "little")  # bf16 1.0, 2.0
    assert torch.equal(codec.decode(payload, 4), torch.tensor([0.0, -2.0, 1.0, 0.0]))


@pytest.mark.parametrize("name,kwargs", CODEC_SETTINGS)
def test_decode_matches_reference_decoder(name, kwargs):
    n = 4096 + 1001  # a full chunk, a short tail, partial blocks and an odd count of nibbles
    x = randn(n) * 3
    codec = make_codec(name, **kwargs)
    payload = codec.encode(x)
    decoded = codec.decode(payload, n)
    expected = torch.zeros(n)
    if name == "topk":
        bits = kwargs["topk_bits"]
        for start, _, (lo, hi), records in parse_topk(payload, n, kwargs["topk_density"], bits):
            for index, code in records:
                expected[start + index] = topk_level(lo, hi, code, bits)
    elif name == "int2":
        nblocks = -(-n // 256)
        grids = [bf16(v) for v in struct.unpack_from(f"<{2 * nblocks}H", payload, 0)]
        codes = [(byte >> shift) & 3 for byte in payload[4 * nblocks:] for shift in (0, 2, 4, 6)][:n]
        expected = torch.stack([topk_level(grids[2 * (i // 256)], grids[2 * (i // 256) + 1], c, 2)
                                for i, c in enumerate(codes)])
    elif name == "sign":
        nblocks = -(-n // 256)
        scales = [bf16(v) for v in struct.unpack_from(f"<{nblocks}H", payload, 0)]
        bits = [(byte >> shift) & 1 for byte in payload[2 * nblocks:] for shift in range(8)][:n]
        expected = torch.tensor([(2 * b - 1) * scales[i // 256] for i, b in enumerate(bits)], dtype=torch.float32)
    else:
        block = 256 if name == "int8" else 128
        scales, codes = parse_block(payload, n, 8 if name == "int8" else 4, block)
        expected = torch.tensor(codes, dtype=torch.float32) * torch.tensor(scales).repeat_interleave(block)[:n]
    assert torch.equal(decoded, expected)


# ---- error bounds --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,block,qmax", [("int8", 256, 127), ("int4", 128, 7)])
def test_block_error_within_half_step(name, block, qmax):
    n = 5 * block + 17
    x = randn(n, seed=1) * torch.linspace(0.01, 50.0, n)
    codec = make_codec(name)
    payload = codec.encode(x)
    scales, codes = parse_block(payload, n, 8 if name == "int8" else 4, block)
    error = (x - codec.decode(payload, n)).abs()
    for b, scale in enumerate(scales):
        part = slice(b * block, (b + 1) * block)
        assert scale == torch.tensor(float(x[part].abs().max()) / qmax, dtype=torch.float32).item()
        assert float(error[part].max()) <= scale / 2 * (1 + 1e-6) + 1e-7
    assert max(abs(q) for q in codes) == qmax


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_each_block_has_its_own_scale(name):
    block = 256 if name == "int8" else 128
    x = torch.cat([randn(block, seed=2) * 1e4, randn(block, seed=3) * 1e-3])
    error = (x - make_codec(name).decode(make_codec(name).encode(x), x.numel())).abs()
    small_absmax = float(x[block:].abs().max())
    assert float(error[block:].max()) <= small_absmax / (127 if name == "int8" else 7) / 2 * (1 + 1e-6)
    assert float(error[block:].max()) < 1e-3  # a shared scale would flush the small block to zero


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("density", [0.01, 0.1])
def test_topk_keeps_the_largest_and_bounds_their_error(bits, density):
    n = 2 * 4096 + 1500
    x = randn(n, seed=4) * torch.linspace(0.1, 10.0, n)
    codec = make_codec("topk", topk_density=density, topk_bits=bits)
    payload = codec.encode(x)
    decoded = codec.decode(payload, n)
    for start, length, (lo, hi), records in parse_topk(payload, n, density, bits):
        chunk, out = x[start:start + length], decoded[start:start + length]
        index = torch.tensor([i for i, _ in records])
        assert len(records) == max(1, round(density * length))
        assert bool((index[1:] > index[:-1]).all()) and int(index.max()) < length
        dropped = torch.ones(length, dtype=torch.bool)
        dropped[index] = False
        assert 0 <= lo <= float(chunk[index].abs().max()) and lo <= hi
        levels = torch.stack([topk_level(lo, hi, c, bits) for c in range(2 ** bits)])
        nearest = (chunk[index, None] - levels).abs().min(dim=1).values
        # each kept value sits on its nearest level
        assert bool(((chunk[index] - out[index]).abs() <= nearest * (1 + 1e-5) + 1e-6).all())
        assert bool((out[dropped] == 0).all())
        assert float(chunk[dropped].abs().max()) <= float(chunk[index].abs().min())


def test_topk_keeps_a_spike_in_every_chunk():
    n = 3 * 4096 + 100
    x = randn(n, seed=5) * 0.01
    spikes = [123, 4096 + 4095, 2 * 4096, 3 * 4096 + 99]
    x[spikes] = torch.tensor([5.0, -7.0, 3.0, 9.0])
    codec = make_codec("topk", topk_density=1e-4, topk_bits=2)  # k = 1 per chunk
    decoded = codec.decode(codec.encode(x), n)
    assert decoded.nonzero().view(-1).tolist() == spikes
    assert decoded[spikes].tolist() == [5.0, -7.0, 3.0, 9.0]  # a lone kept value sits on the ±s level


@pytest.mark.parametrize("bits", [2, 4])
def test_topk_grid_fits_the_kept_values_better_than_their_absmax(bits):
    """Most kept values sit just above the top-k threshold: a grid fitted to them errs far less than levels
    spread from the largest one (the codec's first format, kept here as the reference)."""
    x = randn(8 * 4096, seed=6) * torch.rand(8 * 4096, generator=torch.Generator().manual_seed(7)) ** 3
    codec = make_codec("topk", topk_density=0.02, topk_bits=bits)
    decoded = codec.decode(codec.encode(x), x.numel())
    kept = decoded != 0
    fitted = float((x[kept] - decoded[kept]).norm())
    levels = 2 ** bits
    absmax = 0.0
    for chunk, mask in zip(x.view(-1, 4096), kept.view(-1, 4096)):
        values = chunk[mask]
        s = float(values.abs().max())
        grid = s * (2 * torch.arange(levels) + 1 - levels) / (levels - 1)
        absmax += float(((values[:, None] - grid).abs().min(dim=1).values ** 2).sum())
    assert fitted < 0.6 * math.sqrt(absmax)


def test_topk_ties_go_to_the_lowest_indices():
    x = torch.ones(4096 + 10)
    x[4096 + 3] = -1.0
    codec = make_codec("topk", topk_density=0.01, topk_bits=2)
    chunks = parse_topk(codec.encode(x), x.numel(), 0.01, 2)
    assert [i for i, _ in chunks[0][3]] == list(range(41))
    assert [i for i, _ in chunks[1][3]] == [0]


@pytest.mark.parametrize("name,kwargs", CODEC_SETTINGS)
def test_all_zero_chunks_and_blocks_decode_to_zeros(name, kwargs):
    x = torch.zeros(4096 + 300)
    x[4296] = 2.0  # the first chunk and its blocks stay all-zero, with scale 0
    codec = make_codec(name, **kwargs)
    decoded = codec.decode(codec.encode(x), x.numel())
    if name == "sign":  # the block holding the one value spreads its magnitude over the block
        assert torch.equal(decoded[:4096], x[:4096]) and float(decoded.abs().sum()) == pytest.approx(2.0)
        return
    assert torch.equal(decoded, x)  # topk: the kept zeros fit a grid with lo = 0


# ---- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kwargs", CODEC_SETTINGS)
def test_nbytes_is_exact(name, kwargs):
    codec = make_codec(name, **kwargs)
    for n in SIZES:
        payload = codec.encode(randn(n, seed=n))
        assert len(payload) == codec.nbytes(n), n
        if name == "int8":
            assert len(payload) == 4 * math.ceil(n / 256) + n
        elif name == "int4":
            assert len(payload) == 4 * math.ceil(n / 128) + math.ceil(n / 2)
        elif name == "sign":
            assert len(payload) == 2 * math.ceil(n / 256) + math.ceil(n / 8)


def test_wire_ratios():
    assert wire_ratio(make_codec("topk", topk_density=0.02, topk_bits=2), 1_000_000) < 0.01
    assert wire_ratio(make_codec("int8"), 1_000_000) == pytest.approx(0.254, abs=1e-3)
    assert wire_ratio(make_codec("int4"), 1_000_000) == pytest.approx(0.133, abs=1e-3)
    assert wire_ratio(make_codec("sign"), 1_000_000) == pytest.approx(1.0625 / 32, abs=1e-4)


# ---- determinism ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kwargs", CODEC_SETTINGS)
def test_encode_and_decode_are_deterministic(name, kwargs):
    x = randn(10000, seed=6)
    codec = make_codec(name, **kwargs)
    payload = codec.encode(x)
    assert codec.encode(x.clone()) == payload
    first, second = codec.decode(payload, 10000), codec.decode(bytes(payload), 10000)
    assert torch.equal(first.view(torch.int32), second.view(torch.int32))
    assert first.data_ptr() != second.data_ptr()


# ---- error feedback ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kwargs", CODEC_SETTINGS)
def test_error_feedback_conserves_mass(name, kwargs):
    ef = ErrorFeedback(make_codec(name, **kwargs))
    n, buffer = 5000, None
    total_delta, total_sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for round_ in range(20):
        delta = randn(n, seed=100 + round_)
        payload, sent, buffer = ef.prepare(delta, buffer)
        assert len(payload) == ef.codec.nbytes(n)
        total_delta += delta
        total_sent += sent
    gap = (total_sent + buffer - total_delta).norm() / total_delta.norm()
    assert float(gap) < 1e-4


def test_error_feedback_buffer_stays_bounded():
    ef = ErrorFeedback(make_codec("topk", topk_density=0.01, topk_bits=2))
    buffer, ratios = None, []
    for round_ in range(100):
        delta = randn(8192, seed=200 + round_)
        _, _, buffer = ef.prepare(delta, buffer)
        ratios.append(float(buffer.norm() / delta.norm()))
    # without sending, the buffer is a random walk: ~sqrt(100) = 10 delta norms; EF saturates near 4
    assert ratios[-1] < 6
    assert ratios[-1] < 1.2 * ratios[49]


def test_error_feedback_decay_bounds_the_buffer():
    ef = ErrorFeedback(make_codec("topk", topk_density=0.01, topk_bits=2), decay=0.5)
    buffer = None
    for round_ in range(30):
        delta = randn(4096, seed=300 + round_)
        _, _, buffer = ef.prepare(delta, buffer)
        assert float(buffer.norm()) <= float(delta.norm()) / (1 - 0.5) * 1.01  # geometric series bound


def test_prepare_leaves_its_inputs_alone():
    ef = ErrorFeedback(make_codec("int4"), decay=0.9)
    delta, buffer = randn(300, seed=7), randn(300, seed=8)
    delta_copy, buffer_copy = delta.clone(), buffer.clone()
    payload, sent, new_buffer = ef.prepare(delta, buffer)
    assert torch.equal(delta, delta_copy) and torch.equal(buffer, buffer_copy)
    assert torch.equal(new_buffer, buffer * 0.9 + delta - sent)
    assert torch.equal(sent, ef.codec.decode(payload, 300))
    with pytest.raises(ValueError, match="shape"):
        ef.prepare(delta, randn(299))
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(make_codec("int8"), decay=0.0)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LOSSY_CODECS)
@pytest.mark.parametrize("bad", [torch.empty(0), torch.tensor([1.0, float("nan")]),
                                 torch.tensor([float("inf")]), torch.ones(2, 3),
                                 torch.ones(4, dtype=torch.float64)], ids=["empty", "nan", "inf", "2d", "f64"])
def test_bad_values_are_refused(name, bad):
    with pytest.raises(ValueError):
        make_codec(name).encode(bad)


@pytest.mark.parametrize("name", LOSSY_CODECS)
def test_wrong_payload_length_is_refused(name):
    codec = make_codec(name)
    payload = bytes(codec.encode(randn(1000)))
    for wrong in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(ValueError, match="bytes"):
            codec.decode(wrong, 1000)
    with pytest.raises(ValueError):
        codec.decode(payload, 0)


@pytest.mark.parametrize("scale", [0xBF80, 0x7F80, 0x7FC0], ids=["negative", "inf", "nan"])
def test_corrupt_sign_payload_is_refused(scale):
    with pytest.raises(ValueError, match="corrupt sign payload"):
        make_codec("sign").decode(struct.pack("<H", scale) + b"\x0f", 4)


def test_int2_puts_each_value_on_one_of_two_magnitudes_fitted_to_its_block():
    """Layout and code order (a hand-made payload), the shorter last block fitted to its own values, signs kept,
    and less error than ``sign`` (one magnitude a block) at twice its bits."""
    codec = make_codec("int2")
    assert codec.decode(struct.pack("<2H", 0x3F80, 0x4000) + bytes([0b11100100]), 4).tolist() == [-2, -1, 1, 2]
    x = randn(1000)  # 3 blocks of 256, then one of 232
    payload = codec.encode(x)
    assert len(payload) == codec.nbytes(1000) == 4 * 4 + 250
    y = codec.decode(payload, 1000)
    assert torch.equal(y >= 0, x >= 0)
    for start in range(0, 1000, 256):
        assert len(y[start:start + 256].abs().unique()) == 2
    tail = x[768:].abs()  # fitted to its own values: both magnitudes inside their range
    assert tail.min() <= y[768:].abs().min() and y[768:].abs().max() <= tail.max()
    sign = make_codec("sign")
    assert (y - x).norm() < 0.8 * (sign.decode(sign.encode(x), 1000) - x).norm()
    with pytest.raises(ValueError, match="corrupt int2 payload"):  # lo above hi
        codec.decode(struct.pack("<2H", 0x4000, 0x3F80) + bytes([0]), 4)


@pytest.mark.parametrize("grid,index", [
    ((0x3F80, 0x4000), [0, 9]),  # index 9 lies past a chunk of 4
    ((0x4000, 0x3F80), [0, 1]),  # lo 2 above hi 1
    ((0xBF80, 0x4000), [0, 1]),  # lo -1
    ((0x3F80, 0x7F80), [0, 1]),  # hi infinite
])
def test_corrupt_topk_payload_is_refused(grid, index):
    codec = make_codec("topk", topk_density=0.5, topk_bits=2)
    payload = struct.pack("<2H", *grid) + pack_bits([(torch.tensor(index), 12), (torch.tensor([3, 3]), 2)])
    with pytest.raises(ValueError, match="corrupt"):
        codec.decode(payload, 4)


@pytest.mark.parametrize("kwargs,setting", [
    ({"topk_density": 0.0}, "topk_density"), ({"topk_density": 1.5}, "topk_density"),
    ({"topk_density": float("nan")}, "topk_density"), ({"topk_bits": 3}, "topk_bits"),
    ({"topk_bits": 8}, "topk_bits")])
def test_bad_settings_name_the_setting(kwargs, setting):
    with pytest.raises(ValueError, match=f"--averaging.{setting}"):
        make_codec("topk", **kwargs)


@pytest.mark.parametrize("key,value", [("topk_density", 0.0), ("topk_density", 1.5), ("topk_bits", 3),
                                       ("error_feedback_decay", 0.0), ("error_feedback_decay", 1.5)])
def test_the_config_and_the_codecs_refuse_a_bad_bound_in_the_same_sentence(key, value):
    """Each bound is stated once (in outer_optim.compression), so the config's check and the codec's own refuse a
    value alike."""
    from diloco.config import ConfigError
    from diloco.config.loader import load

    with pytest.raises(ConfigError) as config:
        load(None, [f"--averaging.{key}", str(value)])
    with pytest.raises(ValueError) as codec:
        if key == "error_feedback_decay":
            ErrorFeedback(make_codec("int8"), value)
        else:
            make_codec("topk", **{key: value})
    assert config.value.problems == [str(codec.value)]


def test_unknown_codec():
    with pytest.raises(ValueError, match="--averaging.compression zip is not a codec; use one of none, fp16, int8, int4, int2, "
                                         "sign, topk, auto"):
        make_codec("zip")
    with pytest.raises(ValueError, match="auto picks one of the codecs each round"):
        make_codec("auto")


# ---- bit packing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("widths", [(12, 2), (3,), (4, 4), (12, 4), (1, 7, 5)])
def test_pack_bits_round_trip(widths):
    g = torch.Generator().manual_seed(9)
    fields = [torch.randint(0, 1 << w, (37,), generator=g) for w in widths]
    payload = pack_bits(list(zip(fields, widths)))
    assert len(payload) == math.ceil(37 * sum(widths) / 8)
    stream = int.from_bytes(payload, "little")  # LSB-first: record j starts at bit j * sum(widths)
    assert stream & ((1 << widths[0]) - 1) == int(fields[0][0])
    for got, want in zip(unpack_bits(payload, 37, widths), fields):
        assert torch.equal(got.long(), want)
    with pytest.raises(ValueError, match="fit"):
        pack_bits([(torch.tensor([1 << widths[0]]), widths[0])])


# ---- entropy coding on the wire (outer_optim.compression.entropy) ------------------------------------

@pytest.mark.parametrize("name,kwargs", CODEC_SETTINGS)
def test_entropy_coding_is_lossless_and_never_costs_more_than_a_byte(name, kwargs):
    from outer_optim.compression.entropy import pack, unpack
    codec = make_codec(name, **kwargs)
    for n in (1, 4097, 10000):
        payload = codec.encode(randn(n, seed=n))
        wire = pack(payload)
        assert unpack(wire, len(payload)) == payload
        assert len(wire) <= len(payload) + 1
        assert pack(payload, entropy_coding=False) == b"\x00" + payload
    if name == "int4":  # codes crowd around zero: Huffman coding takes a real share back
        payload = codec.encode(randn(100_000))
        assert len(pack(payload)) < 0.95 * len(payload)


def test_entropy_decoding_refuses_what_is_not_exactly_the_expected_payload():
    """A wrong size, an unknown flag, a truncated or padded stream, and a bomb (a stream that inflates far
    beyond the expected size, which is never inflated past it) all give None; an empty wire is a decline."""
    import zlib

    from outer_optim.compression.entropy import pack, unpack
    payload = bytes(range(16)) * 64
    wire = pack(payload)
    assert wire[:1] == b"\x01" and unpack(wire, len(payload)) == payload
    assert unpack(wire, len(payload) - 1) is None and unpack(wire, len(payload) + 1) is None
    assert unpack(b"\x02" + payload, len(payload)) is None
    assert unpack(wire[:-3], len(payload)) is None and unpack(wire + b"\x00", len(payload)) is None
    coder = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = b"\x01" + coder.compress(bytes(10**8)) + coder.flush()
    assert len(bomb) < 10**6 and unpack(bomb, 1000) is None
    assert unpack(b"", 1000) == b""


# ---- the registry: one source for every list of codecs ----------------------------------------------

def test_the_config_choices_the_docs_and_the_experiments_read_the_registry():
    from pathlib import Path

    from diloco.config.schema import CHOICES
    from experiments.compare import CODEC_ARMS
    from outer_optim.compression import AUTO, AUTO_CODECS, CODECS, REGISTRY, codec_table

    assert CHOICES["averaging.compression"] == CODECS + (AUTO,) and CODECS == tuple(REGISTRY)
    assert list(AUTO_CODECS) == [n for n in CODECS if n in AUTO_CODECS]  # the registry's order: most faithful first
    assert set(LOSSY_CODECS) == {n for n in CODECS if make_codec(n).lossy} and "none" not in LOSSY_CODECS
    assert all(settings["averaging.compression"] in CODECS for settings in CODEC_ARMS.values())
    docs = (Path(__file__).parent.parent / "docs" / "low-bit-codecs.md").read_text()
    assert codec_table() in docs, "docs/low-bit-codecs.md's table is stale: paste codec_table() in"


@pytest.mark.parametrize("gone", ["uint8", "scaled-fp16"])
def test_a_codec_that_is_gone_is_refused_at_config_time_naming_those_that_exist(gone):
    from diloco.config import ConfigError
    from diloco.config.loader import load
    from outer_optim.compression import COMPRESSIONS

    with pytest.raises(ConfigError) as e:
        load(None, ["--averaging.compression", gone])
    assert e.value.problems == [f"--averaging.compression is {gone!r} but must be one of {', '.join(COMPRESSIONS)}"]


# ---- auto: the codec each round's group picks from its measured link ---------------------------------

def test_auto_picks_the_most_faithful_codec_whose_bytes_fit_and_the_fewest_bytes_when_unsure():
    from outer_optim.compression import AUTO_CODECS, choose_codec, exchange_factor

    numels = [4096, 1000]
    codecs = {n: make_codec(n) for n in AUTO_CODECS}
    sent = {n: sum(c.nbytes(k) for k in numels) * exchange_factor(c, 2) for n, c in codecs.items()}
    assert [sent[n] for n in AUTO_CODECS] == sorted((sent[n] for n in AUTO_CODECS), reverse=True)
    per_byte = 1e-6  # 1 MB/s, no latency

    def pick(budget: float) -> str:
        return choose_codec(codecs, numels, 2, lambda b: b * per_byte, budget)

    for name in AUTO_CODECS:  # each budget just fits one codec's bytes
        assert pick(sent[name] * per_byte) == name
    assert pick(sent["none"] * per_byte * 10) == "none"
    assert pick(sent["sign"] * per_byte / 2) == "sign"  # nothing fits: the fewest bytes
    assert pick(float("nan")) == "sign"  # no budget measured yet
    assert choose_codec(codecs, numels, 2, lambda b: None, 1e9) == "sign"  # a member's link unmeasured
    assert choose_codec({n: codecs[n] for n in ("int8", "int4")}, numels, 2, lambda b: b * per_byte, 1e9) == "int8"
    # pessimistic figures (latency not yet told from rate): one codec up from what they allow, never past the first
    explored = [choose_codec(codecs, numels, 2, lambda b: b * per_byte, sent[n] * per_byte, explore=True)
                for n in AUTO_CODECS]
    assert explored == ["none", "none", "fp16", "int8", "int4", "int2"]
    # 3 members of a dense codec reduce-scatter: 4/3 of a payload each rather than 2
    assert exchange_factor(make_codec("int8"), 3) == pytest.approx(4 / 3) and exchange_factor(make_codec("topk"), 3) == 2


def test_a_link_fit_separates_latency_from_rate_once_rounds_differ_in_size():
    from peers.wire.link_fit import LinkFit, explore, group_seconds

    fit = LinkFit()
    assert fit.fitted() is None and fit.published() == {} and not explore([fit.published()])
    fit.add(1e6, 0.2)  # one size: all of it charged to the bytes (larger payloads look slower than they are)
    assert fit.fitted() == (0.0, pytest.approx(0.2e-6))
    assert not fit.separated() and explore([fit.published()])
    fit.add(0, 1.0)
    fit.add(1e6, float("nan"))
    assert len(fit.samples) == 1  # what is no measurement is ignored
    for size in (4e6, 2e6, 8e6):  # 0.1 s of latency, 10 MB/s
        fit.add(size, 0.1 + size / 1e7)
    latency, per_byte = fit.fitted()
    assert latency == pytest.approx(0.1) and per_byte == pytest.approx(1e-7)
    assert fit.separated() and not explore([fit.published()])
    fast = {"latency": 0.05, "per_byte": 1e-8}
    assert group_seconds([fit.published(), fast], 1e6) == pytest.approx(latency + per_byte * 1e6)  # the slowest
    assert group_seconds([fit.published(), {}], 1e6) is None
    assert group_seconds([{"latency": "x", "per_byte": 1}], 1e6) is None  # untrusted metadata
    fit.add(2e6, 0.1 + 2e6 / 1e6)  # the link slowed to 1 MB/s: the next prediction is at the new rate
    assert fit.fitted()[1] == pytest.approx(1e-6, rel=0.1)
    fit = LinkFit(keep=3)
    for i in range(5):
        fit.add(1e6, 1.0 + i)
    assert [t for _, t in fit.samples] == [3.0, 4.0, 5.0]
