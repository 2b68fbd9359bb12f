"""Nunchaku's W4A4 activation quantization, as the CUDA kernel rounds it (docs/quantized.md, "Running SVDQuant
files as they are").

T is the activation dtype (the model's: bf16 or fp16 on the kernel; whatever the run uses here). Every function
takes h, the smoothed input already rounded to T (`smoothed`), and returns the dequantized activations
q·scale in float32, the values the kernel's MMA multiplies:

- int4, signed (every layer but the one below): per token and 64 channels, σ = fp32(amax)·fp32(1/7), codes
  q = clamp(round-half-even(h·(1/σ)), -8, 7) made with the UNROUNDED σ, dequantized with T(σ) (the stored `ascales`).
- int4, unsigned (FLUX.1 down-projections after GELU, inputs shifted by +0.171875 before smoothing):
  σ = fp32(amax)·fp32(1/15), codes clamped to 0..15.
- nvfp4: per token and 16 channels, σ = min(fp32(amax)·fp32(1/6), 448); codes are e2m1 of h·(1/σ), nearest-even,
  saturated at ±6, made with the unrounded σ and dequantized with a8 = e4m3(σ) (nearest-even, subnormals kept).
- A group whose scale is zero contributes zero.

The kernel takes the reciprocal with `rcp.approx.ftz` and divides by s with `__fdividef`; these use exact IEEE
operations, so a code can differ from the kernel's at a rounding tie.
"""

from __future__ import annotations

import torch

SHIFT_GELU = 0.171875  # the kernel's shift of GELU outputs before unsigned int4 quantization
FP8_MAX = 448.0
E2M1_MAX = 6.0


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to `dtype` (nearest-even), back in fp32: T(v) of the notes."""
    return t if dtype == torch.float32 else t.to(dtype).float()


def smoothed(x: torch.Tensor, smooth: torch.Tensor, shift: float = 0.0,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """h = T(fp32(T(x + shift)) / fp32(s)) in fp32, with T = `dtype` (default x.dtype)."""
    t = dtype or x.dtype
    xf = x.float()
    if shift:
        xf = round_to(xf + shift, t)
    return round_to(xf / smooth.float(), t)


def _groups(h: torch.Tensor, size: int) -> torch.Tensor:
    return h.reshape(*h.shape[:-1], h.shape[-1] // size, size)


def int4_codes(h: torch.Tensor, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, σ): integer-valued float32 codes shaped (..., k/64, 64) and the unrounded scales (..., k/64, 1)."""
    g = _groups(h, 64)
    amax = g.abs().amax(dim=-1, keepdim=True)
    sigma = amax * torch.tensor(1.0 / 15.0 if unsigned else 1.0 / 7.0, dtype=torch.float32)
    q = torch.round(g * torch.reciprocal(sigma))
    q = q.clamp_(0, 15) if unsigned else q.clamp_(-8, 7)
    q = torch.where(sigma > 0, q, torch.zeros((), dtype=q.dtype, device=q.device))  # σ = 0: 0·inf is NaN; stored 0
    return q, sigma


def int4_activations(h: torch.Tensor, dtype: torch.dtype, unsigned: bool = False) -> torch.Tensor:
    """Dequantized int4 activations q·T(σ), float32, same shape as h (groups of 64 along the last axis)."""
    q, sigma = int4_codes(h, unsigned)
    return (q * round_to(sigma, dtype)).reshape(h.shape)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest-even E2M1 value of v (the grid 0, .5, 1, 1.5, 2, 3, 4, 6), saturated at ±6."""
    a = v.abs().clamp(max=E2M1_MAX)
    # the grid's step is 0.5 below 2, 1 below 4, 2 up to 6; on each band the code's last bit is the parity of
    # a / step, so torch.round's ties-to-even is the format's nearest-even
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r, v)


def nvfp4_activations(h: torch.Tensor) -> torch.Tensor:
    """Dequantized nvfp4 activations e2m1·e4m3(σ), float32, same shape as h (groups of 16 along the last axis)."""
    g = _groups(h, 16)
    amax = g.abs().amax(dim=-1, keepdim=True)
    sigma = torch.clamp(amax * torch.tensor(1.0 / 6.0, dtype=torch.float32), max=FP8_MAX)
    a8 = sigma.to(torch.float8_e4m3fn).float()
    e = e2m1_round(g * torch.reciprocal(sigma))
    e = torch.where(a8 > 0, e, torch.zeros((), dtype=e.dtype, device=e.device))
    return (e * a8).reshape(h.shape)


def int4_groups_accumulated(act_codes: torch.Tensor, act_scales: torch.Tensor, w_codes: torch.Tensor,
                            w_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's int4 accumulation, group by group in T (10.4), for measuring the fp32 path against it.

    act_codes (tokens, k) and w_codes (n, k) integer-valued float32; act_scales (tokens, k/64) = T(σ);
    w_scales (n, k/64). Per group g in order: acc = T(T(P_g)·T(sa_g·sw_g) + acc), P_g the exact integer dot
    product (the fused multiply-add is emulated in float64, then rounded to T through float32).
    """
    tokens, k = act_codes.shape
    acc = torch.zeros(tokens, w_codes.shape[0], dtype=torch.float64, device=act_codes.device)
    for g in range(k // 64):
        sl = slice(64 * g, 64 * (g + 1))
        p = round_to(act_codes[:, sl] @ w_codes[:, sl].t(), dtype).double()
        scale = round_to(act_scales[:, g:g + 1] * w_scales[:, g][None, :], dtype).double()
        acc = round_to((p * scale + acc).float(), dtype).double()
    return acc.float()


__all__ = ["SHIFT_GELU", "round_to", "smoothed", "int4_codes", "int4_activations", "nvfp4_activations", "e2m1_round",
           "int4_groups_accumulated"]
