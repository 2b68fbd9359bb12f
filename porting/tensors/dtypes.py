"""The project's one dtype vocabulary: safetensors tags, torch dtypes, sizes.

Every module that names a dtype on disk uses the safetensors tag (`BF16`, `F8_E4M3`, ...); this module is the only
place that maps tags to torch dtypes and computes byte sizes from shapes.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

# safetensors dtype tag -> torch dtype
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):  # MXFP8 block scales (E8M0), written by comfy-kitchen
    ST_TO_TORCH["F8_E8M0"] = torch.float8_e8m0fnu
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}

# `--dtype` option values -> tags (`keep` means the source's own dtype)
OPTION_TO_TAG: dict[str, str | None] = {"keep": None, "bf16": "BF16", "bfloat16": "BF16", "fp16": "F16",
                                        "float16": "F16", "fp32": "F32", "float32": "F32"}


def itemsize(tag: str) -> int:
    return ST_TO_TORCH[tag].itemsize


def nbytes(shape: Iterable[int], tag: str) -> int:
    """Bytes a row-major tensor of `shape` and dtype `tag` occupies."""
    return math.prod(shape) * itemsize(tag)


def torch_dtype(tag: str) -> torch.dtype:
    return ST_TO_TORCH[tag]


def tag_of(dtype: torch.dtype) -> str:
    return TORCH_TO_ST[dtype]
