"""ComfyUI's legacy "scaled fp8" layout (e.g. Comfy-Org `*_fp8_scaled.safetensors`).

Declared by a marker tensor `{prefix}scaled_fp8` (its dtype names the fp8 type; a 2-element marker means ComfyUI
runs the matmul in full precision). Each quantized linear has an fp8 `weight` and an fp32 scalar `scale_weight`;
`scale_input` is an activation scale for fp8 matmuls and means nothing for plain weights, so it is dropped and
reported. Dequantized weight = weight * scale_weight.
"""

from __future__ import annotations

from porting.errors import InputError

from ..reader import Checkpoint
from .base import Found, Layout, Scaled, layer_parts

NAME = "ComfyUI scaled fp8"
MARKER = "scaled_fp8"


def _marker(ckpt: Checkpoint) -> str | None:
    found = sorted(k for k in ckpt.tensors if k == MARKER or k.endswith("." + MARKER))
    if len(found) > 1:
        raise InputError(f"{ckpt.path}: {len(found)} scaled_fp8 markers ({', '.join(found[:3])}); one file holds one "
                         "model.", hint="Is this a merged checkpoint (model plus text encoder)? Extract the "
                                        "transformer first.")
    return found[0] if found else None


def claims(ckpt: Checkpoint) -> bool:
    return _marker(ckpt) is not None


def find(ckpt: Checkpoint) -> Found:
    marker = _marker(ckpt)
    assert marker is not None
    prefix = marker[: -len(MARKER)]
    info = ckpt.tensors[marker]
    fp8 = {"F8_E5M2": "float8_e5m2"}.get(info.dtype, "float8_e4m3fn")
    found = Found(NAME, consumed={marker},
                  dropped_why="scale_input is ComfyUI's activation scale for fp8 matmuls; plain weights have no use "
                              "for it")
    if info.numel == 2:
        found.notes.append("marker says full_precision_matrix_mult: ComfyUI ran these layers in full precision")
    scheme = Scaled(f"{fp8} x scale_weight", scale_role="scale_weight", per_row=False)
    for key in ckpt.tensors:
        if key.startswith(prefix) and key.endswith(".scale_weight"):
            layer_parts(ckpt, key[: -len("scale_weight")], scheme, found, dropped=("scale_input",), where=NAME)
    return found


# `recognise` also refuses two markers in one file
LAYOUT = Layout(NAME, sidecars=(MARKER, "scale_weight", "scale_input", "pre_quant_scale"), markers=(MARKER,),
                recognise=claims, find=find)
