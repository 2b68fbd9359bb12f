"""No NaN, Inf or overflow written, ever: the one place for the value checks and for JSON without NaN literals.

Values are checked where they are computed (dequantized row blocks, quantization scales as they are read, adapter
factors, merge sums, casts to a narrower dtype), on tensors already in memory; files are never read again for
it. A refusal is a `NotFinite` (exit 1) naming the file and the tensor. `peak` is one pass over the tensor:
for fp32 / bf16 / fp16 the largest magnitude is read from the bit patterns (their order is the order of the
magnitudes, and Inf / NaN sit above every finite value), so no float copy is made.

torch is imported inside the functions: the CLI's output module imports this one, and light verbs stay torch-free.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from porting.errors import CheckFailed, redact

if TYPE_CHECKING:
    import torch


class NotFinite(CheckFailed):
    """A value that is NaN or infinite, a scale that cannot be one, or a result beyond its dtype's range."""


def dtype_name(dtype: torch.dtype) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(
        str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))


def _where(where: str | Path | Iterable[str | Path] | None) -> str:
    if where is None:
        return ""
    if isinstance(where, (str, Path)):
        return f"{where}: "
    return ", ".join(str(w) for w in where) + ": "


def peak(t: torch.Tensor) -> float:
    """The largest |value| of a floating tensor: inf when one is infinite, nan when one is NaN (0 when empty)."""
    import numpy as np
    import torch

    if t.numel() == 0 or not t.is_floating_point():
        return 0.0
    bits = {torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
            torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00)}.get(t.dtype)
    if bits is None or t.device.type != "cpu":
        lo, hi = (float(v) for v in torch.aminmax(t.detach().reshape(-1).to(torch.float64 if t.dtype ==
                                                                          torch.float64 else torch.float32)))
        return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))
    as_int, mask, exponent = bits
    raw = t.detach().contiguous().view(as_int).numpy().reshape(-1)
    top = int(np.bitwise_and(raw, mask).max())
    if top > exponent:
        return math.nan
    if top == exponent:
        return math.inf
    return float(torch.tensor([top], dtype=as_int).view(t.dtype).item())


def check_tensor(t: torch.Tensor, what: str, where: str | Path | Iterable[str | Path] | None = None,
                 into: torch.dtype | None = None, hint: str | None = None) -> None:
    """Refuse `t` when a value is NaN or infinite, or (with `into`) lies beyond the largest value of `into`."""
    import torch

    top = peak(t)
    if math.isnan(top) or math.isinf(top):
        bad = int((~torch.isfinite(t.detach())).sum())  # only on the way to an error
        raise NotFinite(f"{_where(where)}{what} holds {bad} NaN or infinite value(s); refusing to write it, "
                        "nothing was written.", hint=hint or "The input is damaged or was saved from a diverged "
                                                             "run; use another copy of the file.")
    if into is not None and into.is_floating_point and top > torch.finfo(into).max:
        limit, name = torch.finfo(into).max, dtype_name(into)
        raise NotFinite(f"{_where(where)}{what} would overflow {name}: |value| up to {top:.6g}, the largest {name} "
                        f"is {limit:.6g}; nothing was written.",
                        hint=hint or "Write a dtype with a wider range (bf16 or fp32), or lower the strength.")


def check_number(value: float, what: str, where: str | Path | Iterable[str | Path] | None = None) -> float:
    """Refuse a NaN or infinite number (a strength, an alpha); returns it."""
    if not math.isfinite(value):
        raise NotFinite(f"{_where(where)}{what} is {value}, not a finite number; nothing was written.",
                        hint="Give a finite number.")
    return value


def check_scales(t: torch.Tensor, what: str, where: str | Path | None = None, zero_ok: bool = False) -> None:
    """Quantization scales must be finite and positive (`zero_ok`: block scales of all-zero blocks may be 0)."""
    import torch

    values = t.detach().reshape(-1).float()
    bad = ~torch.isfinite(values) | ((values < 0) if zero_ok else (values <= 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        kind = "negative, NaN or infinite" if zero_ok else "zero, negative, NaN or infinite"
        raise NotFinite(f"{_where(where)}quantization scale {what} holds {int(bad.sum())} value(s) that are {kind} "
                        f"(the first at index {i}: {float(values[i])!r}); dequantizing with it would write "
                        "wrong or non-finite weights, so nothing was written.",
                        hint="The file is damaged or was quantized incorrectly; use another release.")


# --- JSON ---------------------------------------------------------------------------------------------------------

def json_ready(doc: Any, path: str = "", replaced: list[str] | None = None) -> Any:
    """`doc` with every NaN / Inf float replaced by None (JSON null); their paths are appended to `replaced`."""
    if isinstance(doc, float) and not math.isfinite(doc):
        if replaced is not None:
            replaced.append(path or "(document)")
        return None
    if isinstance(doc, dict):
        return {k: json_ready(v, f"{path}.{k}" if path else str(k), replaced) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [json_ready(v, f"{path}[{i}]", replaced) for i, v in enumerate(doc)]
    return doc


NOTE_KEY = "null_means_not_finite"  # lists the fields whose value was NaN or Inf, written as null


def dumps(doc: Any, replaced: list[str] | None = None, **kwargs: Any) -> str:
    """`json.dumps` that never writes a NaN / Infinity literal: non-finite floats become null, and a document
    (a dict) that had any says so under `null_means_not_finite` (their paths, also appended to `replaced`);
    `allow_nan=False` makes anything left over an error instead of invalid JSON. No credential is written
    (`errors.redact` over the text: a JSON string escapes no character a credential is made of)."""
    found: list[str] = []
    clean = json_ready(doc, replaced=found)
    if found and isinstance(clean, dict):
        clean[NOTE_KEY] = found
    if replaced is not None:
        replaced.extend(found)
    return redact(json.dumps(clean, allow_nan=False, **kwargs))
