"""Nunchaku's packed SVDQuant layouts, written: each function runs one unpacker of `svdq_packing.py` backwards.

An unpacker reshapes the stored bytes to (tiles, *AXES), permutes them with PERM and flattens; a packer reshapes
the logical tensor to the permuted axes, applies the inverse permutation and flattens again. The layouts are named
once, in `svdq_packing.py`; the tests hold these packers to deepcompressor's own (`NunchakuWeightPacker`, TinyChat's
`pack_w4`) byte for byte.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .svdq_packing import (
    CODE_AXES,
    CODE_PERM,
    LOWRANK_AXES,
    LOWRANK_PERM,
    MICRO_AXES,
    MICRO_PERM,
    SCALE_AXES,
    SCALE_PERM,
    TILE_K,
    TILE_N,
)


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


def _backwards(logical: torch.Tensor, stored_axes: Sequence[int], perm: Sequence[int]) -> torch.Tensor:
    """The stored order of `logical`, when unpacking is `stored.reshape(stored_axes).permute(perm)`."""
    permuted = [stored_axes[p] for p in perm]
    return logical.reshape(permuted).permute(_inverse(perm)).contiguous()


def code_bytes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (n, k), values 0..15 -> row-major bytes (n, k/2) uint8, column 2j in the low nibble of byte j."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (n, k), 0..15 (int4 two's complement or E2M1 indices) -> `qweight` (n, k/2) int8 in MMA tiles."""
    n, k = codes.shape
    t = _backwards(code_bytes(codes), (n // TILE_N, k // TILE_K, *CODE_AXES), (*CODE_PERM,))
    return t.reshape(n, k // 2).view(torch.int8)


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """int4 group scales (n, groups) -> stored (groups, n) in 128-channel permuted tiles."""
    n, groups = scales.shape
    return _backwards(scales, (n // TILE_N, groups, *SCALE_AXES), SCALE_PERM).reshape(groups, n)


def pack_vector(vector: torch.Tensor) -> torch.Tensor:
    """A per-channel vector (bias, smooth, wcscales) in logical order -> the scales' channel order."""
    n = vector.numel()
    return pack_scales(vector.reshape(n, 1)).reshape(n)


def pack_micro_scales(scales: torch.Tensor) -> torch.Tensor:
    """nvfp4 micro-scales (n, k/16) float8_e4m3fn -> stored (k/16, n) permuted."""
    n, groups = scales.shape
    k = groups * 16
    t = _backwards(scales.view(torch.uint8), (n // TILE_N, k // TILE_K, *MICRO_AXES), MICRO_PERM)
    return t.reshape(groups, n).view(torch.float8_e4m3fn)


def pad_rank(t: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    """Zeros appended along `dim` up to `rank` (the kernel's rank is a multiple of 16)."""
    missing = rank - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pack_lowrank(weight: torch.Tensor, down: bool) -> torch.Tensor:
    """D (r, k) -> `proj_down` (k, r); U (n, r) -> `proj_up` (n, r), in 16x16 register tiles (r a multiple of 16)."""
    if down:
        r, c = weight.shape
        tiles = weight.reshape(r // 16, 16, c // 16, 16).permute(2, 0, 1, 3)  # undoes permute(1, 2, 0, 3)
    else:
        c, r = weight.shape
        tiles = weight.reshape(c // 16, 16, r // 16, 16).permute(0, 2, 1, 3)  # its own inverse
    return _backwards(tiles, (c // 16, r // 16, *LOWRANK_AXES), LOWRANK_PERM).reshape(c, r)


def pack_awq_codes(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned codes (n, k), 0..15 -> TinyChat W4A16 `qweight` (n/4, k/2) int32 (the inverse of `unpack_awq_codes`)."""
    n, k = codes.shape
    c = codes.to(torch.int32).reshape(n, k // 32, 4, 8).permute(0, 1, 3, 2).reshape(n, k // 4, 4)
    words = c[..., 0] | (c[..., 1] << 4) | (c[..., 2] << 8) | (c[..., 3] << 12)  # 16 bits, 0..65535
    words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    t = words.reshape(n // 4, 4, k // 64, 16).permute(0, 2, 1, 3).reshape(n // 4, k)
    return t.contiguous().view(torch.int32)


def interleave_rows(t: torch.Tensor, splits: int) -> torch.Tensor:
    """Logical row j*(n/S) + d -> stored row d*S + j (Nunchaku's adaLN layers; undone by `deinterleave_rows`)."""
    n = t.shape[0]
    return t.reshape(splits, n // splits, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


__all__ = ["code_bytes", "pack_codes", "pack_scales", "pack_vector", "pack_micro_scales", "pad_rank",
           "pack_lowrank", "pack_awq_codes", "interleave_rows"]
