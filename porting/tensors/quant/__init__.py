"""Quantized safetensors layouts, one module per producer's format; `decode` applies the one a header declares.

Detection reads headers only (plus ComfyUI's tiny `comfy_quant` JSON tensors) and never guesses: layouts with a
marker (ComfyUI's `scaled_fp8`, `comfy_quant` / `_quantization_metadata`) are declared by it; the marker-less
`weight_scale` layouts (BFL / diffusers' BFL scheme, ModelOpt int8) are told apart by stored dtypes and shapes.
Two layouts claiming one file is an error, not a choice.
"""

from __future__ import annotations

from types import ModuleType

from porting.errors import InputError, UnsupportedQuantizationError
from porting.tensors.quant import bfl_scheme, comfy_mixed, comfy_scaled_fp8, modelopt_int8
from porting.tensors.quant.svdq import reader as svdq

from ..reader import Checkpoint
from .base import is_sidecar, rewrite

# a marker in the file says which layout (nunchaku: its metadata, or packed `qweight` with `wscales` and a low-rank
# or smoothing part)
DECLARED: tuple[ModuleType, ...] = (comfy_mixed, comfy_scaled_fp8, svdq)
BY_SIDECARS: tuple[ModuleType, ...] = (bfl_scheme, modelopt_int8)  # no marker: `weight_scale` next to the weight

# stored-key endings of layouts flux-port recognises and refuses (no exact way to plain weights)
REFUSED_KEYS = {
    ("qweight", "qzeros"): "AWQ / GPTQ (packed int4 with zero points)",
}


def _refuse_unsupported(ckpt: Checkpoint) -> None:
    endings = {k.rsplit(".", 1)[-1] for k in ckpt.tensors}
    for needed, what in REFUSED_KEYS.items():
        if set(needed) <= endings:
            example = next(k for k in ckpt.tensors if k.endswith("." + needed[0]))
            raise UnsupportedQuantizationError(
                f"{ckpt.path}: quantized as {what} (e.g. {example!r}); flux-port refuses it: it cannot turn this "
                "layout into plain weights exactly. Nothing was written.",
                hint="Use an fp8, nvfp4, mxfp8, int8, GGUF or bf16 release of the same model.")


def decode(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt` itself when no quantized layout is declared, else the same file seen as plain (computed) weights."""
    _refuse_unsupported(ckpt)
    claimed = [m for m in DECLARED if m.claims(ckpt)] or [m for m in BY_SIDECARS if m.claims(ckpt)]
    if not claimed:
        return ckpt
    if len(claimed) > 1:
        names = " and ".join(m.NAME for m in claimed)
        raise InputError(f"{ckpt.path}: the header fits two quantized layouts ({names}); flux-port will not guess "
                         "which one the producer meant.", hint="Report the file's origin; the layouts differ in "
                         "nibble order and scale layout, so reading it the wrong way gives wrong weights silently.")
    layout = claimed[0]
    # a layout whose plain tensors are not its stored ones (renamed, split, joined) builds its own view
    return layout.view(ckpt) if hasattr(layout, "view") else rewrite(ckpt, layout.find(ckpt))


__all__ = ["decode", "is_sidecar", "DECLARED", "BY_SIDECARS"]
