"""The project's one dtype vocabulary: safetensors tags, torch dtypes, sizes.

Every module that names a dtype on disk uses the safetensors tag (`BF16`, `F8_E4M3`, ...); this module is the only
place that maps tags to torch dtypes and computes byte sizes from shapes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

# safetensors dtype tag -> (torch dtype name, bytes per element); torch itself is imported only when a tensor is
# made, so header-only verbs (inspect, plans) start without it
TAGS: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),  # MXFP8 block scales (E8M0), written by comfy-kitchen
}


def _tables() -> tuple[dict[str, Any], dict[Any, str]]:
    import torch

    st_to_torch = {tag: getattr(torch, name) for tag, (name, _) in TAGS.items() if hasattr(torch, name)}
    return st_to_torch, {v: k for k, v in st_to_torch.items()}


def __getattr__(name: str) -> Any:
    """`ST_TO_TORCH` (tag -> torch dtype) and `TORCH_TO_ST`, built on first use."""
    if name in ("ST_TO_TORCH", "TORCH_TO_ST"):
        st_to_torch, torch_to_st = _tables()
        globals().update(ST_TO_TORCH=st_to_torch, TORCH_TO_ST=torch_to_st)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `--dtype` option values -> tags (`keep` means the source's own dtype)
OPTION_TO_TAG: dict[str, str | None] = {"keep": None, "bf16": "BF16", "bfloat16": "BF16", "fp16": "F16",
                                        "float16": "F16", "fp32": "F32", "float32": "F32"}


def itemsize(tag: str) -> int:
    return TAGS[tag][1]


def nbytes(shape: Iterable[int], tag: str) -> int:
    """Bytes a row-major tensor of `shape` and dtype `tag` occupies."""
    return math.prod(shape) * itemsize(tag)


def torch_dtype(tag: str) -> torch.dtype:
    import torch

    return getattr(torch, TAGS[tag][0])


def tag_of(dtype: torch.dtype) -> str:
    return __getattr__("TORCH_TO_ST")[dtype]
