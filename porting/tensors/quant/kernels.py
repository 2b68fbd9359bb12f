"""Dequantization arithmetic, written from the formats' definitions (float32 out, row ranges where it matters)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# E2M1 (FP4) code -> value; bit 3 is the sign
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def scaled(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`weight * scale` in float32 for a scalar scale or one scale per row (`[rows]` or `[rows, 1]`)."""
    s = scale.float()
    if s.numel() == 1:
        return weight.float() * s.reshape(())
    return weight.float() * s.reshape(-1, *([1] * (weight.dim() - 1)))


@dataclass(frozen=True)
class CodeTable:
    """The dequantized value of every code of a one-byte storage dtype, as bit patterns of the output dtype."""

    bits: np.ndarray  # 256 entries, or 65536 code pairs (little-endian) for two-byte outputs
    out: torch.dtype

    @property
    def pairs(self) -> bool:
        return self.bits.size == 65536


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def code_table(codes: torch.dtype, scale: torch.Tensor, out: torch.dtype) -> CodeTable:
    """Each of the 256 codes' value times `scale` in float32, rounded to `out`: exactly what
    `(weight.float() * scale).to(out)` computes element by element."""
    values = (torch.arange(256, dtype=torch.uint8).view(codes).float() * scale.float().reshape(())).to(out)
    bits = values.view(_BITS[out.itemsize]).numpy().copy()
    if out.itemsize == 2:  # one lookup per two codes
        u = bits.view(np.uint16).astype(np.uint32)
        bits = ((u[:, None] << 16) | u[None, :]).reshape(-1)  # index high * 256 + low -> value(high) << 16 | value(low)
    return CodeTable(bits, out)


def lookup(weight: torch.Tensor, table: CodeTable) -> torch.Tensor:
    """`weight`'s one-byte codes through `table`: a tensor of `table.out`, same shape."""
    codes = weight.contiguous().view(torch.uint8).numpy().reshape(-1)
    if table.pairs and codes.size % 2 == 0:
        pairs = np.empty(codes.size // 2, dtype=table.bits.dtype)
        np.take(table.bits, codes.view(np.uint16), out=pairs, mode="clip")  # every index is in range
        flat = pairs.view(np.uint16)
    elif table.pairs:
        u = table.bits.reshape(256, 256)[0]  # value(0) << 16 | value(low): the low halves hold single values
        flat = np.take((u & 0xFFFF).astype(np.uint16), codes)
    else:
        flat = np.take(table.bits, codes)
    return torch.from_numpy(flat).view(table.out).reshape(weight.shape)


def unpack_fp4(packed: torch.Tensor, high_first: bool) -> torch.Tensor:
    """uint8 [rows, K/2] holding two E2M1 codes per byte -> float32 [rows, K].

    `high_first`: the even-index element sits in the high nibble (ComfyUI / comfy-kitchen); otherwise in the low
    nibble (ModelOpt / diffusers' BFL scheme).
    """
    hi, lo = packed >> 4, packed & 0x0F
    pair = (hi, lo) if high_first else (lo, hi)
    codes = torch.stack(pair, dim=-1).reshape(packed.shape[0], -1)
    return E2M1_VALUES[codes.long()]


def unswizzle_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales stored in cuBLAS's tiled layout for block-scaled GEMMs -> row-major [rows, cols].

    The padded [128 * R, 4 * C] matrix is stored as R x C tiles of 128 x 4 scales, tile by tile; inside a tile the
    scale at (32 * i + j, c) sits at position (j, 4 * i + c) of a 32 x 16 block.
    """
    r_tiles, c_tiles = -(-rows // 128), -(-cols // 4)
    if blocked.numel() != r_tiles * c_tiles * 512:
        raise ValueError(f"swizzled scales hold {blocked.numel()} values, [{rows}, {cols}] needs "
                         f"{r_tiles * c_tiles * 512} after padding")
    t = blocked.reshape(r_tiles, c_tiles, 32, 4, 4)  # tile row, tile col, j, i, c
    t = t.permute(0, 3, 2, 1, 4)  # tile row, i, j, tile col, c
    return t.reshape(r_tiles * 128, c_tiles * 4)[:rows, :cols]


def nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
          high_first: bool) -> torch.Tensor:
    """NVFP4: E2M1 values in blocks of 16, each times an E4M3 block scale times the fp32 global scale.

    `block_scales` are row-major [rows, K/16] (already unswizzled where the layout swizzles them).
    """
    values = unpack_fp4(packed, high_first)
    rows, k = values.shape
    scale = block_scales.float() * global_scale.float().reshape(())
    return (values.reshape(rows, k // 16, 16) * scale[:, :, None]).reshape(rows, k)


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 block scales (stored as uint8 or float8_e8m0fnu) -> float32 2^(e - 127); e == 0 reads as 0."""
    e = exponents.view(torch.uint8).to(torch.int32)
    return torch.where(e == 0, torch.zeros((), dtype=torch.int32), e << 23).view(torch.float32)


def mxfp8(weight: torch.Tensor, block_exponents: torch.Tensor) -> torch.Tensor:
    """MXFP8: fp8 values in blocks of 32 along K, each times a power-of-two E8M0 scale ([rows, K/32] row-major)."""
    rows, k = weight.shape
    scale = e8m0_to_float(block_exponents)
    return (weight.float().reshape(rows, k // 32, 32) * scale[:, :, None]).reshape(rows, k)
