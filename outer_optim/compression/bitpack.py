"""Bytes and bit streams of the codecs' payloads: little-endian multi-byte numbers, LSB-first bit fields.

A bit stream puts bit j at bit j % 8 of byte j // 8 and is padded with zero bits to a whole byte.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
import torch.nn.functional as F

LITTLE_ENDIAN = sys.byteorder == "little"


def to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def from_bytes(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def to_le(t: torch.Tensor) -> torch.Tensor:
    """Values of a 2- or 4-byte dtype -> (n, size) uint8 little-endian bytes."""
    raw = t.contiguous().view(torch.uint8).view(-1, t.element_size())
    return raw if LITTLE_ENDIAN else raw.flip(1)


def from_le(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, size) uint8 little-endian bytes -> values of ``dtype``."""
    raw = raw if LITTLE_ENDIAN else raw.flip(1)
    return raw.reshape(-1).clone().view(dtype)  # a fresh, aligned copy that a dtype view accepts


def pack_rows(fields: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Packs fields of shape (rows, n) into (rows, ceil(n*W/8)) uint8, each row its own stream."""
    width = sum(w for _, w in fields)
    if not 0 < width <= 31:  # records live in int32, which halves the memory traffic of int64
        raise ValueError(f"a packed record must be 1 to 31 bits wide, not {width}")
    rows, n = fields[0][0].shape
    record, shift = torch.empty(0, dtype=torch.int32), 0
    for values, w in fields:
        values = values.to(torch.int32)
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << w):
            raise ValueError(f"a value does not fit its {w}-bit field")
        record = values if shift == 0 else record | (values << shift)
        shift += w
    if width % 8 == 0:  # whole bytes per record: skip the per-bit expansion
        out = torch.empty(rows, n, width // 8, dtype=torch.uint8)
        for j in range(width // 8):
            out[..., j] = record >> (8 * j)  # the uint8 copy keeps the low byte
        return out.view(rows, -1)
    bits = torch.empty(rows, n, width, dtype=torch.uint8)
    for j in range(width):
        bits[..., j] = (record >> j) & 1
    nbytes = (n * width + 7) // 8
    bits = F.pad(bits.view(rows, -1), (0, nbytes * 8 - n * width)).view(rows, nbytes, 8)
    out = bits[..., 0].clone()
    for j in range(1, 8):
        out |= bits[..., j] << j
    return out


def unpack_rows(data: torch.Tensor, n: int, widths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of `pack_rows`: (rows, nbytes) uint8 -> one (rows, n) int32 tensor per field."""
    width = sum(widths)
    rows = data.shape[0]
    if width % 8 == 0:
        parts = data[:, :n * width // 8].reshape(rows, n, width // 8).to(torch.int32)
    else:
        bits = torch.empty(rows, data.shape[1], 8, dtype=torch.uint8)
        for j in range(8):
            bits[..., j] = (data >> j) & 1
        parts = bits.view(rows, -1)[:, :n * width].reshape(rows, n, width).to(torch.int32)
    step = 8 if width % 8 == 0 else 1
    record = parts[..., 0]
    for j in range(1, parts.shape[-1]):
        record = record | (parts[..., j] << (step * j))
    out, shift = [], 0
    for w in widths:
        out.append((record >> shift) & ((1 << w) - 1))
        shift += w
    return out


def pack_bits(fields: Sequence[tuple[torch.Tensor, int]]) -> bytes:
    """Packs equally long 1-D integer tensors as records (field 0 in the lowest bits), LSB-first."""
    return to_bytes(pack_rows([(v.reshape(1, -1), w) for v, w in fields]))


def unpack_bits(payload: bytes, n: int, widths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of `pack_bits`: ``n`` records of the given field widths -> one int32 tensor per field."""
    if len(payload) != (n * sum(widths) + 7) // 8:
        raise ValueError(f"{n} records of {sum(widths)} bits need {(n * sum(widths) + 7) // 8} bytes, "
                         f"not {len(payload)}")
    return [f.view(-1) for f in unpack_rows(from_bytes(payload).view(1, -1), n, widths)]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``n`` codes of ``bits`` bits (1, 2, 4 or 8) -> ceil(n*bits/8) uint8, the first code in the lowest bits."""
    per_byte = 8 // bits
    codes = F.pad(codes, (0, -codes.numel() % per_byte)).view(-1, per_byte)
    return pack_rows([(codes[:, j].view(1, -1), bits) for j in range(per_byte)])


def unpack_codes(data: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes (int32) of the uint8 ``data``."""
    per_byte = 8 // bits
    fields = unpack_rows(data.view(1, -1), -(-numel // per_byte), [bits] * per_byte)
    return torch.stack(fields, dim=-1).view(-1)[:numel]
