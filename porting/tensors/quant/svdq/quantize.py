"""Data-free SVDQuant of one linear layer: smoothing from the weights, a top-r low-rank branch, 4-bit residual.

For W (out n x in k) the kernel computes y = Q4(x / s) · R^T + x · D^T · U^T + b, so the layer holds

    W ≈ R · diag(1/s) + U · D          R on the 4-bit grid, U (n x r) and D (r x k) in bf16, s in bf16

Smoothing rule (data-free): SmoothQuant's s_j = max|X_j|^α / max|W_:,j|^(1-α) with α = 0.5 and every activation
channel assumed to have the same range (without data nothing tells them apart), so s_j ∝ max|W_:,j|^-1/2,
normalised to a geometric mean of 1 and bounded by raising column maxima below 1e-3 of the largest to that floor.
It halves (in log scale) the spread of column ranges the weight grid must cover, and widens the spread of the
activation channels the kernel quantizes by at most the square root of the same ratio (31.6x with the floor).

Low-rank branch: the top-r singular directions of W·diag(s) (singular values split evenly between U and D); D is
stored divided by s (it acts on the raw input). The residual is taken against the bf16 factors as stored, so their
rounding is absorbed by the 4-bit part. int4: one bf16 scale amax/7 per 64 inputs, codes -8..7 (nearest, ties to
even). nvfp4: E2M1 codes with one fp8 (e4m3) scale per 16 inputs, times a bf16 per-tensor scale amax/(6·448) (one
per fused piece, stored as `wcscales`, when a layer fuses several tensors). AWQ W4A16 (FLUX.1's adaLN layers):
asymmetric int4 per 64 inputs, w = q·scale + zero with q 0..15.

Everything is float32 and works on a band of rows at a time, so one layer's float32 copy is the peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from porting.tensors.quant.svdq.tiles import E2M1

ALPHA = 0.5
SMOOTH_FLOOR = 1e-3
OVERSAMPLE, POWER_ITERS = 16, 2  # the randomized range finder's extra columns and subspace iterations
FULL_SVD_MAX = 1024  # layers whose smaller side is at most this get an exact SVD
BAND = 2**22  # float32 values per band of rows in the rounding passes (16 MiB)
FP8_MAX = 448.0
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between E2M1's magnitudes


@dataclass
class LayerErrors:
    """Per-row squared errors (float64): of W_eff and of plain 4-bit rounding of W, and W's own squared norm."""

    quantized: torch.Tensor
    plain: torch.Tensor
    norm: torch.Tensor


@dataclass
class W4A4Parts:
    """One SVDQuant layer in logical order (the packers turn it into the file's tensors)."""

    codes: torch.Tensor  # (n, k) uint8 nibbles: int4 two's complement, or E2M1 indices
    scales: torch.Tensor  # int4 (n, k/64) bf16; nvfp4 (n, k/16) float8_e4m3fn
    tensor_scales: torch.Tensor | None  # nvfp4: bf16, one per piece
    smooth: torch.Tensor  # (k,) bf16
    up: torch.Tensor  # (n, r) bf16
    down: torch.Tensor  # (r, k) bf16, acting on the raw input
    residual_rowsum: torch.Tensor  # (n,) float32: row sums of R·diag(1/s) (the GELU-shift bias correction)
    errors: LayerErrors


@dataclass
class AwqParts:
    codes: torch.Tensor  # (n, k) uint8 0..15, logical row order
    scales: torch.Tensor  # (n, k/64) bf16
    zeros: torch.Tensor  # (n, k/64) bf16
    errors: LayerErrors


def _bands(n: int, k: int) -> range:
    return range(0, n, max(1, BAND // max(k, 1)))


def row_norms(w: torch.Tensor) -> torch.Tensor:
    """Per-row squared norms (float64), a band at a time."""
    n, k = w.shape
    return torch.cat([w[a:a + BAND // k].double().pow(2).sum(dim=1) for a in _bands(n, k)])


def smoothing(w: torch.Tensor, x_max: torch.Tensor | None = None) -> torch.Tensor:
    """The smoothing factors of W (n, k) as bf16: data-free (module docstring), or with `x_max`, the calibrated
    per-channel input maxima, SmoothQuant's s_j = max|X_j|^α / max|W_:,j|^(1-α) (same floor, same normalisation)."""
    cmax = torch.zeros(w.shape[1])
    for a in _bands(*w.shape):
        cmax = torch.maximum(cmax, w[a:a + BAND // w.shape[1]].abs().amax(dim=0))
    top = cmax.max()
    if not top > 0:
        return torch.ones(w.shape[1], dtype=torch.bfloat16)
    cmax = cmax.clamp_min(top * SMOOTH_FLOOR)
    s = cmax.pow(-(1 - ALPHA))
    if x_max is not None and x_max.max() > 0:
        x = x_max.float().clamp_min(x_max.max() * SMOOTH_FLOOR)
        s = s * x.pow(ALPHA)
    s = s / torch.exp(torch.log(s).mean())
    return s.to(torch.bfloat16)


def top_singular(ws: torch.Tensor, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(U (n, r), D (r, k)) float32 with U·D the best rank-r approximation of `ws` (randomized for large layers,
    with a fixed seed: the same file every run)."""
    n, k = ws.shape
    r = min(rank, n, k)
    if min(n, k) <= FULL_SVD_MAX:  # in float64: the bf16 factors then do not depend on the thread count
        u, sv, vh = (t.float() for t in torch.linalg.svd(ws.double(), full_matrices=False))
    else:
        gen = torch.Generator().manual_seed(seed)
        q = min(r + OVERSAMPLE, n, k)
        basis = torch.linalg.qr(ws @ torch.randn(k, q, generator=gen)).Q
        for _ in range(POWER_ITERS):
            basis = torch.linalg.qr(ws @ torch.linalg.qr(ws.T @ basis).Q).Q
        small_u, sv, vh = torch.linalg.svd(basis.T @ ws, full_matrices=False)
        u = basis @ small_u
    root = sv[:r].sqrt()
    return u[:, :r] * root, root[:, None] * vh[:r]


def round_int4(r: torch.Tensor, group: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (n, k) uint8 nibbles, scales (n, k/group) bf16, dequantized float32) of symmetric int4 rounding."""
    n, k = r.shape
    g = r.reshape(n, k // group, group)
    scales = (g.abs().amax(dim=-1) / 7).to(torch.bfloat16)
    s = scales.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp_(-8, 7)
    deq = (q * s).reshape(n, k)
    codes = (q.to(torch.int16) & 0xF).to(torch.uint8).reshape(n, k)
    return codes, scales, deq


def nvfp4_tensor_scale(amax: float) -> torch.Tensor:
    """The bf16 per-tensor scale that puts the largest micro-scale at the top of e4m3's range (1 for zeros)."""
    t = torch.tensor([amax / (6 * FP8_MAX)]).to(torch.bfloat16)
    return t if t.item() > 0 else torch.ones(1, dtype=torch.bfloat16)


def round_nvfp4(r: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 codes (n, k) uint8, fp8 micro-scales (n, k/16), dequantized float32) with the per-row tensor scale
    `row_scale` (n,) float32."""
    n, k = r.shape
    t = row_scale.view(n, 1, 1)
    g = r.reshape(n, k // 16, 16)
    sub = (g.abs().amax(dim=-1, keepdim=True) / 6 / t).clamp_(0, FP8_MAX).to(torch.float8_e4m3fn)
    unit = sub.float() * t
    x = torch.where(unit > 0, g / torch.where(unit > 0, unit, 1.0), 0.0)
    mag = torch.bucketize(x.abs(), _MIDPOINTS)
    codes = (mag + 8 * ((x < 0) & (mag > 0))).to(torch.uint8)
    deq = torch.tensor(E2M1)[codes.long()] * unit
    return codes.reshape(n, k), sub.reshape(n, k // 16), deq.reshape(n, k)


def plain_error(w: torch.Tensor, precision: str) -> torch.Tensor:
    """Per-row squared error of plain 4-bit rounding of W (same group size, no smoothing, no branch)."""
    n, k = w.shape
    out = torch.empty(n, dtype=torch.float64)
    t = nvfp4_tensor_scale(w.abs().max().item()).float() if precision == "nvfp4" else None
    for a in _bands(n, k):
        band = w[a:a + BAND // k]
        if t is None:
            deq = round_int4(band)[2]
        else:
            deq = round_nvfp4(band, t.expand(band.shape[0]))[2]
        out[a:a + band.shape[0]] = (deq - band).double().pow(2).sum(dim=1)
    return out


def quantize_w4a4(w: torch.Tensor, precision: str, rank: int, pieces: list[int], seed: int = 0,
                  x_max: torch.Tensor | None = None, smooth: torch.Tensor | None = None,
                  amax: float | None = None) -> W4A4Parts:
    """SVDQuant of W (n, k) float32; `pieces`: the row counts of the fused tensors it is made of; `x_max`: calibrated
    input maxima (None: data-free smoothing); `smooth`: the smoothing factors to use (bf16), shared with the other
    layers reading the same input (they then join into one layer exactly); `amax` (nvfp4): the largest value the
    per-tensor scale must cover, shared with the layers reading the other columns of one linear (`residual_amax`).

    A layer whose weights have no low-rank structure to take out (i.i.d.-like values: the residual is then no
    smaller, only more peaked, and rounds worse) would come out worse than plain rounding; it is stored with s = 1
    and a zero branch instead, which is plain rounding exactly (with a shared `smooth`: that s and a zero branch,
    when that rounds better). `w` is used as scratch."""
    n, k = w.shape
    norm = row_norms(w)
    plain = plain_error(w, precision)
    s = smoothing(w, x_max) if smooth is None else smooth
    w.mul_(s.float())  # W·diag(s)
    u, d = top_singular(w, rank, seed)
    up, down = u.to(torch.bfloat16), (d / s.float()).to(torch.bfloat16)
    rounded = _round(w, precision, pieces, s, up, down, amax)
    if rounded[-1].sum() > plain.sum():
        for a in _bands(n, k):  # w holds R·diag(1/s): W again
            w[a:a + BAND // k].addmm_(up[a:a + BAND // k].float(), down.float())
        if smooth is None:
            s = torch.ones(k, dtype=torch.bfloat16)
        else:
            w.mul_(s.float())  # W·diag(s) again, for the same s
        kept = (up, down, rounded)
        up, down = torch.zeros_like(up), torch.zeros_like(down)
        rounded = _round(w, precision, pieces, s, up, down, amax)
        if smooth is not None and rounded[-1].sum() > kept[2][-1].sum():
            up, down, rounded = kept
    codes, scales, tensor_scales, rowsum, err = rounded
    return W4A4Parts(codes, scales, tensor_scales, s, up, down, rowsum, LayerErrors(err, plain, norm))


def _round(w: torch.Tensor, precision: str, pieces: list[int], s: torch.Tensor, up: torch.Tensor,
           down: torch.Tensor, amax: float | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Round the residual R = W·diag(s) - U·D·diag(s) (`w` holds W·diag(s), and R·diag(1/s) afterwards):
    (codes, scales, nvfp4 per-piece tensor scales, row sums of R·diag(1/s), per-row squared error against W)."""
    n, k = w.shape
    sf = s.float()
    d_smoothed = down.float() * sf  # the stored D, back on the smoothed input
    tensor_scales = row_scale = None
    if precision == "nvfp4":
        for a in _bands(n, k):  # the residual first: the per-tensor scale needs its largest value
            w[a:a + BAND // k].sub_(up[a:a + BAND // k].float() @ d_smoothed)
        starts = [sum(pieces[:i]) for i in range(len(pieces))]
        tensor_scales = torch.cat([nvfp4_tensor_scale(w[a:a + m].abs().max().item() if amax is None else amax)
                                   for a, m in zip(starts, pieces)])
        row_scale = torch.cat([tensor_scales[i:i + 1].float().expand(m) for i, m in enumerate(pieces)])
    codes = torch.empty(n, k, dtype=torch.uint8)
    group = 16 if precision == "nvfp4" else 64
    scales = torch.empty(n, k // group, dtype=torch.float8_e4m3fn if precision == "nvfp4" else torch.bfloat16)
    rowsum = torch.empty(n)
    err = torch.empty(n, dtype=torch.float64)
    for a in _bands(n, k):
        band = w[a:a + BAND // k]
        b = a + band.shape[0]
        if row_scale is None:
            band.sub_(up[a:b].float() @ d_smoothed)
            c, sc, deq = round_int4(band)
        else:
            c, sc, deq = round_nvfp4(band, row_scale[a:b])
        codes[a:b], scales[a:b] = c, sc
        deq.div_(sf)
        rowsum[a:b] = deq.sum(dim=1)
        err[a:b] = (deq - band.div_(sf)).double().pow(2).sum(dim=1)
    return codes, scales, tensor_scales, rowsum, err


def quantize_awq(w: torch.Tensor, group: int = 64) -> AwqParts:
    """Asymmetric int4 per `group` inputs, w = q·scale + zero (TinyChat W4A16 as Nunchaku runs it)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15).to(torch.bfloat16)
    zeros = lo.to(torch.bfloat16)
    s, z = scales.float().unsqueeze(-1), zeros.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round((g - z) / torch.where(s > 0, s, 1.0)), 0.0).clamp_(0, 15)
    err = row_norms((q * s + z - g).reshape(n, k))
    return AwqParts(q.to(torch.uint8).reshape(n, k), scales, zeros, LayerErrors(err, plain_error(w, "int4"),
                                                                                row_norms(w)))


def residual_amax(w: torch.Tensor, rank: int, seed: int = 0, x_max: torch.Tensor | None = None) -> float:
    """The largest value `quantize_w4a4` may round for W (n, k) float32: of the residual W·diag(s) - U·D·diag(s),
    and of W itself (what it rounds when it falls back to plain rounding). Layers that read the columns of one
    linear take the largest over all of them as their nvfp4 per-tensor scale, so they join into that linear
    exactly (one scale per row there)."""
    s = smoothing(w, x_max).float()
    ws = w * s
    u, d = top_singular(ws, rank, seed)
    up, down = u.to(torch.bfloat16).float(), (d / s).to(torch.bfloat16).float()
    return max(float((ws - up @ (down * s)).abs().max()), float(w.abs().max()))


def rel(err2: float, norm2: float) -> float:
    return math.sqrt(err2 / norm2) if norm2 > 0 else math.sqrt(err2)


__all__ = ["ALPHA", "LayerErrors", "W4A4Parts", "AwqParts", "smoothing", "top_singular", "round_int4",
           "round_nvfp4", "nvfp4_tensor_scale", "plain_error", "quantize_w4a4", "quantize_awq", "residual_amax",
           "rel"]
