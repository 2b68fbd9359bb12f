"""Quantized safetensors layouts, one module per producer's format; `decode` applies the one a header declares.

Detection reads headers only (plus ComfyUI's tiny `comfy_quant` JSON tensors) and never guesses: layouts with a
marker (ComfyUI's `scaled_fp8`, `comfy_quant` / `_quantization_metadata`, Nunchaku's packed `qweight` with
`wscales`) are declared by it; the marker-less `weight_scale` layouts (BFL / diffusers' BFL scheme, ModelOpt int8)
are told apart by stored dtypes and shapes. Two layouts claiming one file is an error, not a choice. Which layouts
exist, and in which order they are asked, is `registry.LAYOUTS`.
"""

from __future__ import annotations

from porting.errors import InputError

from ..reader import Checkpoint
from ..sidecars import is_sidecar
from . import registry


def decode(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt` itself when no quantized layout is declared, else the same file seen as plain (computed) weights."""
    for layout in registry.refused():
        if layout.claims(ckpt):
            layout.decode(ckpt)  # raises, naming the layout
    claimed = ([m for m in registry.declared() if m.claims(ckpt)]
               or [m for m in registry.by_sidecars() if m.claims(ckpt)])
    if not claimed:
        return ckpt
    if len(claimed) > 1:
        names = " and ".join(m.name for m in claimed)
        raise InputError(f"{ckpt.path}: the header fits two quantized layouts ({names}); flux-port will not guess "
                         "which one the producer meant.", hint="Report the file's origin; the layouts differ in "
                         "nibble order and scale layout, so reading it the wrong way gives wrong weights silently.")
    return claimed[0].decode(ckpt)


__all__ = ["decode", "is_sidecar", "registry"]
