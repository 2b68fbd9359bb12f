"""Norm-wise error metrics between a candidate tensor and a golden tensor."""

from __future__ import annotations

import math

import torch

# unit roundoff per dtype; the ratio denominator is clamped at a fraction of it so that an almost exact
# reference does not turn a tiny device error into a huge ratio
ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
# element-wise relative errors use max(|golden|, floor) as denominator (msprobe's small-value cut-off)
SMALL_VALUE = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-14, torch.float64: 2.0**-14}


# float32's floor follows msprobe's fp32 denominator floor (2^-14) rather than its unit roundoff: accumulation error
# through a deep network is orders of magnitude above 2^-24, so two correct fp32 implementations (torch and
# onnxruntime's kernels) differ by far more than the roundoff-based floor, and a ratio against it means nothing.
FLOOR_BASE = {**ROUNDOFF, torch.float32: 2.0**-14}


def error_floor(dtype: torch.dtype) -> float:
    return FLOOR_BASE.get(dtype, 2.0**-8) / 4


def compare(candidate: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """cosine, rel_l2, rmse, max_abs, mean_abs, share of elements with relative error above 1e-3 / 5e-3, NaN/Inf."""
    a = candidate.detach().to("cpu", torch.float64).reshape(-1)
    b = golden.detach().to("cpu", torch.float64).reshape(-1)
    nonfinite = int((~torch.isfinite(a)).sum())
    if nonfinite:
        return {"cosine": math.nan, "rel_l2": math.inf, "rmse": math.inf, "max_abs": math.inf,
                "mean_abs": math.inf, "frac_re_gt_1e-3": 1.0, "frac_re_gt_5e-3": 1.0,
                "nonfinite": nonfinite, "numel": a.numel()}
    diff = a - b
    norm_b = float(b.norm())
    rel = diff.abs() / b.abs().clamp_min(SMALL_VALUE.get(dtype, 2.0**-8))
    denom = float(a.norm()) * norm_b
    return {
        # (a * b).sum(), not a @ b: BLAS dot products may split the sum differently from run to run (MKL picks its
        # thread count by load), and a report must be reproducible to the last digit, across processes too
        "cosine": float((a * b).sum()) / denom if denom else (1.0 if float(diff.norm()) == 0 else 0.0),
        "rel_l2": float(diff.norm()) / norm_b if norm_b else float(diff.norm()),
        "rmse": float(diff.pow(2).mean().sqrt()),
        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
        "mean_abs": float(diff.abs().mean()) if diff.numel() else 0.0,
        "frac_re_gt_1e-3": float((rel > 1e-3).double().mean()) if rel.numel() else 0.0,
        "frac_re_gt_5e-3": float((rel > 5e-3).double().mean()) if rel.numel() else 0.0,
        "nonfinite": 0,
        "numel": a.numel(),
    }


def error_ratio(device_err: float, intrinsic_err: float, dtype: torch.dtype) -> float:
    """device error / intrinsic error of the dtype, denominator clamped at the dtype's floor."""
    if not math.isfinite(device_err):
        return math.inf
    return device_err / max(intrinsic_err, error_floor(dtype))
