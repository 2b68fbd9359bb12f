"""NVIDIA ModelOpt int8 (W8A8) files: int8 weights with an fp32 per-channel `weight_scale`.

Declared by `<layer>.weight_scale` next to an int8 weight (no ComfyUI marker). Dequantized weight =
weight * weight_scale[:, None] (one scale per output row; a single scale also reads correctly). `input_scale`, the
activation scale of the int8 matmul, is dropped and reported.
"""

from __future__ import annotations

from ..reader import Checkpoint
from .base import Found, Layout, Scaled, layer_parts, weight_scale_layers

NAME = "ModelOpt int8 (per-channel weight_scale)"
SCHEME = Scaled("int8 x weight_scale (per channel)", weight_dtypes=("I8",))


def _layers(ckpt: Checkpoint) -> list[str]:
    return weight_scale_layers(ckpt, ("I8",))


def claims(ckpt: Checkpoint) -> bool:
    return bool(_layers(ckpt))


def find(ckpt: Checkpoint) -> Found:
    found = Found(NAME, dropped_why="input_scale is the int8 matmul's activation scale; plain weights have no use "
                                    "for it")
    for prefix in _layers(ckpt):
        layer_parts(ckpt, prefix, SCHEME, found, where=NAME)
    return found


# no marker: `weight_scale` next to an int8 weight
LAYOUT = Layout(NAME, sidecars=("weight_scale", "input_scale", "pre_quant_scale"), recognise=claims, find=find)
