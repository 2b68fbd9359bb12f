"""Nunchaku's packed SVDQuant layouts, both ways: `unpack_*` reads a stored tensor, `pack_*` writes one.

The layouts: 4-bit MMA tiles, permuted scales and vectors, low-rank tiles, AWQ.

Each `unpack_*` is the inverse of one of deepcompressor's packers (`NunchakuWeightPacker.pack_weight`,
`pack_scale`, `pack_micro_scale`, `pack_lowrank_weight`; TinyChat's `pack_w4` for the AWQ W4A16 layers); the
permutations are written as the inverse index orders of the packers' (deepcompressor's `pack` modules). The tests
hold them to deepcompressor's own packers.
"""

from __future__ import annotations

from typing import Sequence

import torch

TILE_N = 128  # output rows per packed tile (warp_n)
TILE_K = 64  # input columns per packed tile (insn_k for 4 bits)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Each layout as (axes of the stored order, the permutation to the logical order); the packers below run them backwards.
CODE_AXES, CODE_PERM = (1, 8, 8, 4, 2, 2, 1, 4), (0, 3, 6, 4, 8, 1, 2, 7, 5, 9)  # after (n/128, k/64); bytes
SCALE_AXES, SCALE_PERM = (1, 8, 4, 2, 2), (0, 2, 3, 5, 4, 6, 1)  # after (n/128, groups)
MICRO_AXES, MICRO_PERM = (1, 8, 4, 4, 4), (0, 2, 5, 4, 3, 1, 6)  # after (n/128, k/64)
LOWRANK_AXES, LOWRANK_PERM = (8, 4, 2, 2, 1, 2), (0, 1, 4, 2, 6, 5, 3, 7)  # after (c/16, r/16)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes -> their two 4-bit codes, low nibble first (int16 0..15, one more trailing axis of 2)."""
    b = packed.view(torch.uint8).to(torch.int16)
    return torch.stack((b & 0xF, b >> 4), dim=-1)


def unpack_code_bytes(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`qweight` (n, k/2) int8 in MMA tile order -> the same bytes in row-major order (uint8 (n, k/2), column 2j in
    the low nibble of byte j).

    The tile permutation keeps each 32-bit word's eight codes together, so it moves whole bytes: 1 byte per two
    codes, not a tensor of codes. `n` may be a band of whole 128-row tiles (stored n-tile outer, so contiguous).
    """
    t = qweight.view(torch.uint8).reshape(n // TILE_N, k // TILE_K, *CODE_AXES)
    return t.permute(CODE_PERM).reshape(n, k // 2)


def unpack_codes(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`qweight` (n, k/2) int8 in MMA tile order -> the 4-bit codes (n, k) in row-major order (int16 0..15)."""
    return nibbles(unpack_code_bytes(qweight, n, k)).reshape(n, k)


def byte_values(precision: str) -> torch.Tensor:
    """float32 (256, 2): the values of a byte's low and high code (int4 two's complement, or nvfp4 E2M1)."""
    codes = nibbles(torch.arange(256, dtype=torch.uint8))
    return e2m1(codes) if precision == "nvfp4" else signed_int4(codes).float()


def decode_values(qweight: torch.Tensor, n: int, k: int, precision: str) -> torch.Tensor:
    """`qweight` -> float32 (n, k) code values, by one lookup of each byte's two values (int32 indices: about 2x
    faster than int64 ones, and faster than shifting nibbles apart)."""
    packed = unpack_code_bytes(qweight, n, k).reshape(-1).int()
    return byte_values(precision).index_select(0, packed).reshape(n, k)


def int4_band_values(code_bytes: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row-major code bytes (rows, k/2) uint8 (two's complement nibbles, column 2j low) and their group scales
    (rows, k/64) -> code·scale (rows, k) in `dtype`, in one vectorized pass: arithmetic shifts of the bytes read as
    int8 give both signed nibbles, no lookup. `dtype` float32 is exact; bfloat16 (bf16 scales) is the float32
    value rounded once to bf16, as torch multiplies bf16 in float32."""
    rows, groups = scales.shape
    b = code_bytes.view(torch.int8)
    q = torch.stack(((b << 4) >> 4, b >> 4), dim=-1).view(rows, groups, -1).to(dtype)
    return q.mul_(scales.to(dtype)[:, :, None]).view(rows, -1)


def nvfp4_band_values(code_bytes: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row-major E2M1 code bytes (rows, k/2) uint8 and their micro-scales (rows, k/16) float8_e4m3fn -> e2m1·scale
    float32 (rows, k), without a lookup: a nibble's sign, two exponent bits and mantissa bit, placed at bits 15,
    11-10 and 9 of a float16, are that E2M1 value times 2^-14 (exponent 0 reads as the subnormal 0.5·2^-14); the 2^14
    goes into the scales, which stays exact (an e4m3 scale times a power of two). Every product (2 by 4 mantissa
    bits) is exact in float32 and in bfloat16, the other `dtype` it is meant for."""
    rows, groups = scales.shape
    b = code_bytes.to(torch.int16)
    lo = ((b & 0x7) << 9) | ((b & 0x8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    v = torch.stack((lo, hi), dim=-1).view(torch.float16).view(rows, groups, -1).to(dtype)
    return v.mul_((scales.float() * 2.0**14).to(dtype)[:, :, None]).view(rows, -1)


def awq_band_values(code_bytes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Row-major unsigned code bytes (rows, k/2) uint8, per-64 scales and zeros (rows, k/64) -> q·scale + zero
    float32 (rows, k) (AWQ W4A16)."""
    rows, groups = scales.shape
    q = torch.stack((code_bytes & 0xF, code_bytes >> 4), dim=-1).view(rows, groups, -1).float()
    return q.mul_(scales.float()[:, :, None]).add_(zeros.float()[:, :, None]).view(rows, -1)


def signed_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two's complement nibbles: 8..15 are -8..-1."""
    return torch.where(codes >= 8, codes - 16, codes)


def e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (bit 3 the sign) -> their float32 values."""
    return torch.tensor(E2M1, dtype=torch.float32)[codes.long()]


def unpack_scales(wscales: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """int4 group scales stored (groups, n) in 128-channel permuted tiles -> (n, groups)."""
    t = wscales.reshape(n // TILE_N, groups, *SCALE_AXES)
    return t.permute(SCALE_PERM).reshape(n, groups)


def unpack_vector(vector: torch.Tensor) -> torch.Tensor:
    """A per-channel vector (bias, smooth, wcscales) stored in the scales' channel order -> logical order."""
    n = vector.numel()
    return unpack_scales(vector.reshape(1, n), n, 1).reshape(n)


def unpack_micro_scales(wscales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """nvfp4 fp8 micro-scales (one per 16 inputs) stored (k/16, n) permuted -> (n, k/16) float8_e4m3fn."""
    t = wscales.view(torch.uint8).reshape(n // TILE_N, k // TILE_K, *MICRO_AXES)
    return t.permute(MICRO_PERM).reshape(n, k // 16).view(torch.float8_e4m3fn)


def unpack_lowrank(weight: torch.Tensor, down: bool) -> torch.Tensor:
    """`proj_down` (k, r) -> D (r, k); `proj_up` (n, r) -> U (n, r), from 16x16 register tiles."""
    c, r = weight.shape
    t = weight.reshape(c // 16, r // 16, *LOWRANK_AXES).permute(LOWRANK_PERM)
    t = t.reshape(c // 16, r // 16, 16, 16)
    if down:
        return t.permute(1, 2, 0, 3).reshape(r, c)
    return t.permute(0, 2, 1, 3).reshape(c, r)


def unpack_awq_codes(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """TinyChat W4A16 `qweight` (n/4, k/2) int32 -> unsigned codes (n, k) int16 0..15."""
    words = qweight.view(torch.int16).reshape(n // 4, k // 64, 4, 16).permute(0, 2, 1, 3).reshape(n, k // 4)
    w = words.to(torch.int32) & 0xFFFF
    codes = torch.stack([(w >> (4 * i)) & 0xF for i in range(4)], dim=-1)  # (n, k/4, nibble)
    return codes.reshape(n, k // 32, 8, 4).permute(0, 1, 3, 2).reshape(n, k).to(torch.int16)


def deinterleave_rows(t: torch.Tensor, splits: int) -> torch.Tensor:
    """Stored row d*S + j is logical row j*(n/S) + d (Nunchaku's adaLN layers): back to logical order."""
    n = t.shape[0]
    return t.reshape(n // splits, splits, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


__all__ = ["TILE_N", "TILE_K", "E2M1", "CODE_AXES", "CODE_PERM", "SCALE_AXES", "SCALE_PERM", "MICRO_AXES",
           "MICRO_PERM", "LOWRANK_AXES", "LOWRANK_PERM", "nibbles", "unpack_code_bytes", "unpack_codes", "byte_values",
           "decode_values", "int4_band_values", "nvfp4_band_values",
           "awq_band_values", "signed_int4", "e2m1", "unpack_scales", "unpack_vector", "unpack_micro_scales",
           "unpack_lowrank", "unpack_awq_codes", "deinterleave_rows"]


# Writing: each packer runs one unpacker above backwards (reshape to the permuted axes, inverse permutation,
# flatten); the tests hold them to deepcompressor's own packers byte for byte.
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
