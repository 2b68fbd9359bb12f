"""Key names that only mean something next to a quantized weight (torch-free, so header-only verbs can check).

A key ending in one of them that no layout consumed must never be dropped silently: it would leave a raw quantized
weight behind as if it were the weight.
"""

from __future__ import annotations

from typing import Iterable, Mapping

SIDECAR_NAMES = ("scale_weight", "scale_input", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale",
                 "comfy_quant", "scaled_fp8", "qweight", "qzeros", "wscales", "wzeros", "smooth_factor",
                 "smooth_orig", "smooth_factor_orig", "proj_down", "proj_up", "wtscale", "wcscales")
METADATA_KEYS = ("_quantization_metadata",)  # ComfyUI's header-level layer configs


def is_sidecar(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in SIDECAR_NAMES


def may_be_quantized(keys: Iterable[str], metadata: Mapping[str, str]) -> bool:
    """False when no quantized layout can apply: no sidecar key and no quantization metadata."""
    return any(k in metadata for k in METADATA_KEYS) or any(is_sidecar(k) for k in keys)
