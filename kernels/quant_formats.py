"""The quantized weight formats the CPU kernels compute on, and how a GGUF file's blocks
are split into them (kernels/quant_gemv.py's `QuantWeight.from_blocks`).

Every format becomes the same shape of data, so the kernel's inner loop only unpacks
values: groups of 32 weights, each stored as unsigned integers v_i of `bits` bits
(`pack_values`), with one float32 scale per `scale_group` weights (32, or 16 for Q6_K)
and, for the formats with a min, one float32 m per 32 weights:

    w_i = d * (v_i - offset)        formats without m (Q8_0, Q4_0, Q5_0, Q6_K, int8)
    w_i = d * v_i + m               formats with m (Q4_1, Q5_1, Q4_K, Q5_K; m = -dmin * min_j)

d and m are computed exactly as gguf.quants' dequantize_blocks computes them, in float32,
and the two formulas are the ones it evaluates, so `dequantize` is bit-exact with gguf's.

Packed bytes per 32 weights, in the kernel's layout (kernels/cpu/quant_gemv.h):
    8 bits: 32 int8 (v - offset, two's complement; offset 0)
    4 bits: 16 bytes, byte i = v_i | v_{i+16} << 4
    5 bits: those 16 bytes of low nibbles, then a little-endian uint32 whose bit i is bit 4 of v_i
    6 bits: those 16 bytes of low nibbles, then two little-endian uint32 bit planes: bit i of
            the first is bit 4 of v_i, of the second bit 5 (the kernel turns each plane into a
            lane mask: one masked OR per 16 values)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # weights per packed group


@dataclass(frozen=True)
class Format:
    """One format as the kernel sees it. code: the C++ kernel's qtype (quant_gemv.h's QType);
    block/type_size: the GGUF block (weights, bytes); None for formats made here (int8)."""

    name: str
    code: int
    bits: int
    offset: int
    has_m: bool
    scale_group: int
    block: int | None
    type_size: int | None

    @property
    def group_bytes(self) -> int:
        """Packed bytes per 32 weights."""
        return {8: 32, 4: 16, 5: 20, 6: 24}[self.bits]


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("Q8_0", 0, 8, 0, False, 32, 32, 34),
    Format("Q4_1", 1, 4, 0, True, 32, 32, 20),
    Format("Q4_0", 2, 4, 8, False, 32, 32, 18),
    Format("Q5_0", 3, 5, 16, False, 32, 32, 22),
    Format("Q5_1", 4, 5, 0, True, 32, 32, 24),
    Format("Q6_K", 5, 6, 32, False, 16, 256, 210),
    Format("Q4_K", 1, 4, 0, True, 32, 256, 144),  # the Q4_1 kernel: sub-blocks of 32 with d and m
    Format("Q5_K", 4, 5, 0, True, 32, 256, 176),  # the Q5_1 kernel
    Format("int8", 0, 8, 0, False, 32, None, None),  # per-channel: the Q8_0 kernel, the row's scale per group
)}
GGUF_FORMATS = tuple(name for name, f in FORMATS.items() if f.block is not None)


@dataclass
class Split:
    """A weight in the kernel's layout. v: uint8 [N, K] unsigned values; d: float32
    [N, K / scale_group]; m: float32 [N, K / 32] or None."""

    v: np.ndarray
    d: np.ndarray
    m: np.ndarray | None


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row of b [n, 2] → float32 [n, 1]: the file's fp16 scale, widened."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [n, 16] → [n, 32]: low nibbles are values 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5_x)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K/Q5_K block → 6-bit scales and mins, [n, 8] each (gguf's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes → [n, 8, 32] low nibbles: sub-block 2c is chunk c's low nibbles,
    2c + 1 its high nibbles (chunks of 32 bytes)."""
    c = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (c & 15).reshape(-1, 8, 32)


def _split_blocks(name: str, b: np.ndarray) -> Split:
    """b: uint8 [nblocks, type_size] → values [nblocks, block] and scales per block's groups."""
    n = b.shape[0]
    if name == "Q8_0":
        return Split(b[:, 2:], _f16(b[:, :2]), None)  # int8 values as their bytes
    if name == "Q4_0":
        return Split(_nibbles(b[:, 2:]), _f16(b[:, :2]), None)
    if name == "Q4_1":
        return Split(_nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]))
    if name in ("Q5_0", "Q5_1"):
        at = 2 if name == "Q5_0" else 4
        qh = np.unpackbits(b[:, at:at + 4], axis=-1, bitorder="little")  # [n, 32]: bit i of the uint32
        v = _nibbles(b[:, at + 4:]) | (qh << 4)
        return Split(v, _f16(b[:, :2]), None if name == "Q5_0" else _f16(b[:, 2:4]))
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        if name == "Q4_K":
            v = _k_low(b[:, 16:144])
        else:
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            v = _k_low(b[:, 48:176]) | ((qh & 1) << 4)
        return Split(v.reshape(n, 256), d * sc, -(dmin * mn))
    if name == "Q6_K":
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        v = (ql & 15).reshape(n, 256) | ((qh & 3).reshape(n, 256) << 4)
        return Split(v, _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32), None)
    raise ValueError(f"no block split for {name!r}")


def split_gguf(blocks: np.ndarray, name: str) -> Split:
    """A GGUF tensor's rows as stored (uint8 [N, K / block * type_size]) → the kernel's layout."""
    f = FORMATS[name]
    N = blocks.shape[0]
    s = _split_blocks(name, np.ascontiguousarray(blocks).reshape(-1, f.type_size))
    return Split(s.v.reshape(N, -1), s.d.reshape(N, -1), None if s.m is None else s.m.reshape(N, -1))


def pack_values(v: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values uint8 [N, K] → the kernel's packed bytes [N, K / 32 * group_bytes]."""
    N = v.shape[0]
    g = v.reshape(N, -1, GROUP)
    if bits == 8:
        return np.ascontiguousarray(v)
    low = (g[..., :16] & 15) | ((g[..., 16:] & 15) << 4)  # [N, K/32, 16]
    if bits == 4:
        return np.ascontiguousarray(low.reshape(N, -1))
    planes = [np.packbits((g >> bit) & 1, axis=-1, bitorder="little") for bit in range(4, bits)]  # [N, K/32, 4] each
    high = np.concatenate(planes, axis=-1)
    return np.ascontiguousarray(np.concatenate([low, high], axis=-1).reshape(N, -1))


def unpack_values(qs: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's packed bytes uint8 [N, K / 32 * group_bytes] → unsigned values int32 [N, K]."""
    N = qs.shape[0]
    if bits == 8:
        return qs.to(torch.int32)
    g = qs.reshape(N, -1, {4: 16, 5: 20, 6: 24}[bits]).to(torch.int32)
    v = torch.cat([g[..., :16] & 15, g[..., :16] >> 4], dim=-1)  # [N, K/32, 32]
    for plane, bit in enumerate(range(4, bits)):  # bit planes of 32 bits after the nibbles
        at = 16 + 4 * plane
        word = g[..., at] | g[..., at + 1] << 8 | g[..., at + 2] << 16 | g[..., at + 3] << 24  # int32 wraps: & 1 below
        v = v | (((word[..., None] >> torch.arange(32)) & 1) << bit)
    return v.reshape(N, -1)


def dequantize(f: Format, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """→ float32 [N, K], evaluated as gguf evaluates it (the kernels' reference)."""
    N = qs.shape[0]
    v = unpack_values(qs, f.bits)
    if f.bits == 8:
        v = v.to(torch.uint8).view(torch.int8).to(torch.int32)  # stored two's complement
    ds = d.repeat_interleave(f.scale_group, dim=1)  # [N, K]
    if f.has_m:
        return ds * v.float() + m.repeat_interleave(GROUP, dim=1)
    return ds * (v - f.offset).float()


def int8_per_channel(weight: torch.Tensor) -> Split:
    """Symmetric int8 per output row: s = max|w_row| / 127 (float32), q = w / s rounded half away
    from zero, clamped to [-127, 127]; an all-zero row gets s = 0 and q = 0. w ≈ s * q."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(f"int8 weights must be [N, K] with K a multiple of {GROUP}, got {tuple(weight.shape)}")
    w = weight.detach().float()
    s = w.abs().amax(dim=1, keepdim=True) / 127  # [N, 1]
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = (w / safe)
    q = (torch.sign(q) * torch.floor(q.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    d = s.expand(-1, w.shape[1] // GROUP).contiguous()  # the kernel's per-group scales
    return Split(q.view(torch.uint8).numpy(), d.numpy(), None)
