"""Black Forest Labs' quantized releases and diffusers' BFL-scheme files: `weight_scale` sidecars, no markers.

Declared by `<layer>.weight_scale` next to an fp8 or packed-fp4 weight, with no ComfyUI marker in the file. The
scheme of each layer follows from stored dtypes and shapes, which are unambiguous:
- fp8 weight, one scale: BFL's official fp8 files (weight * weight_scale per tensor);
- fp8 weight, one scale per row `[N]`: fp8r (diffusers `quantizers/bfl`, `dequantize_fp8r`);
- uint8 weight `[N, K/2]` with `weight_scale_2`: NVFP4 as ModelOpt and diffusers' BFL scheme store it, the even
  element in the **low** nibble and E4M3 block scales **row-major** `[N, K/16]` (the opposite of ComfyUI's layout;
  reading one as the other gives a ~120% error and raises nothing, so the choice is made by the markers, not here).
`input_scale` (activation scale) is dropped and reported.
"""

from __future__ import annotations

from porting.errors import InputError

from ..reader import Checkpoint
from .base import NVFP4, Found, Layout, Scaled, layer_parts, weight_scale_layers

NAME = "BFL-scheme quantized"
FP8 = ("F8_E4M3", "F8_E5M2")

PER_TENSOR = Scaled("fp8 x weight_scale (per tensor, BFL)", per_row=False, weight_dtypes=FP8)
PER_ROW = Scaled("fp8r (per-row weight_scale)", per_row=True, weight_dtypes=FP8)
NVFP4_BFL = NVFP4("nvfp4 (BFL scheme: low nibble first, row-major scales)", high_first=False, swizzled=False)


def _layers(ckpt: Checkpoint) -> list[str]:
    """Prefixes of layers with a `weight_scale` whose weight is fp8 or packed fp4."""
    return weight_scale_layers(ckpt, (*FP8, "U8"))


def claims(ckpt: Checkpoint) -> bool:
    return bool(_layers(ckpt))


def find(ckpt: Checkpoint) -> Found:
    found = Found(NAME, dropped_why="input_scale is an activation scale for quantized matmuls; plain weights have "
                                    "no use for it")
    for prefix in _layers(ckpt):
        weight, scale = ckpt.tensors[prefix + "weight"], ckpt.tensors[prefix + "weight_scale"]
        if weight.dtype == "U8":
            if prefix + "weight_scale_2" not in ckpt.tensors:
                raise InputError(f"{ckpt.path}: {prefix}weight is packed uint8 with a weight_scale but no "
                                 "weight_scale_2; not an NVFP4 layout flux-port knows.")
            scheme = NVFP4_BFL
        else:
            scheme = PER_TENSOR if scale.numel == 1 else PER_ROW
        layer_parts(ckpt, prefix, scheme, found, where=NAME)
    fmt = {layer.scheme.name for layer in found.layers.values()}
    if fmt == {PER_TENSOR.name}:
        found.format = "BFL fp8 (per-tensor weight_scale)"
    elif fmt <= {PER_ROW.name, NVFP4_BFL.name}:
        found.format = "diffusers BFL scheme (fp8r / nvfp4)"
    return found


# no marker: `weight_scale` next to an fp8 or packed-fp4 weight
LAYOUT = Layout(NAME, sidecars=("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale"), recognise=claims,
                find=find)
