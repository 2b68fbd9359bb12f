"""ComfyUI's mixed-precision layout (`comfy/quant_ops.py`, quantized with comfy-kitchen).

Declared per layer by a `<layer>.comfy_quant` uint8 tensor holding UTF-8 JSON (`{"format": "nvfp4", ...}`) or by
the header's `_quantization_metadata` (`{"format_version": "1.0", "layers": {layer: {...}}}`); layers without one
are plain. Formats:
- `float8_e4m3fn`, `float8_e5m2`, `int8_tensorwise`: weight * `weight_scale`;
- `nvfp4`: E2M1 pairs with the even element in the **high** nibble, E4M3 block-16 scales in cuBLAS's **swizzled**
  tiled layout, times `weight_scale_2`;
- `mxfp8`: fp8 weight times swizzled E8M0 block-32 scales.
`pre_quant_scale` (input smoothing) is folded into the weight's columns; `input_scale` is dropped and reported.
Rotated or codebook formats (ConvRot, SVDQuant, AWQ, W4A8) are refused: turning them into plain weights needs
their exact inverse transforms, which flux-port does not implement.
"""

from __future__ import annotations

from porting._files import parse_json
from porting.errors import InputError, UnsupportedQuantizationError

from ..reader import Checkpoint, read_bytes
from .base import MXFP8, NVFP4, Found, Layout, Scaled, Scheme, layer_parts

NAME = "ComfyUI mixed precision"
MARKER = ".comfy_quant"
METADATA_KEY = "_quantization_metadata"

SCHEMES: dict[str, Scheme] = {
    "float8_e4m3fn": Scaled("float8_e4m3fn x weight_scale", per_row=False, weight_dtypes=("F8_E4M3",)),
    "float8_e5m2": Scaled("float8_e5m2 x weight_scale", per_row=False, weight_dtypes=("F8_E5M2",)),
    "int8_tensorwise": Scaled("int8_tensorwise x weight_scale", weight_dtypes=("I8",)),
    "nvfp4": NVFP4("nvfp4 (ComfyUI: high nibble first, swizzled scales)", high_first=True, swizzled=True),
    "mxfp8": MXFP8("mxfp8 (swizzled E8M0 scales)"),
}
REFUSED = {
    "convrot": "ConvRot (Hadamard-rotated int8)", "convrot_w4a4": "ConvRot W4A4 (Hadamard-rotated int4)",
    "svdquant_w4a4": "SVDQuant W4A4 (4-bit weights plus a low-rank branch)", "awq_w4a16": "AWQ W4A16",
    "asym_w4a8_int8": "asymmetric W4A8 int8",
}


def claims(ckpt: Checkpoint) -> bool:
    return METADATA_KEY in ckpt.metadata or any(k.endswith(MARKER) for k in ckpt.tensors)


def _layer_config(conf: object, where: str) -> dict:
    """One layer's quantization config: an object whose "format" is a string (anything else is refused by name)."""
    if not isinstance(conf, dict):
        raise InputError(f"{where}: a layer's quantization config must be a JSON object, found "
                         f"{type(conf).__name__}.")
    if not isinstance(conf.get("format"), str):
        raise InputError(f"{where}: \"format\" is {conf.get('format')!r}; it must be a format name (a string).")
    return conf


def _configs(ckpt: Checkpoint) -> dict[str, dict]:
    """Layer prefix (ending in '.') -> its JSON config, from the header metadata and the comfy_quant tensors."""
    configs: dict[str, dict] = {}
    if METADATA_KEY in ckpt.metadata:
        where = f"{ckpt.path}: header metadata {METADATA_KEY}"
        doc = parse_json(ckpt.metadata[METADATA_KEY], str(ckpt.path), what=f"header metadata {METADATA_KEY}")
        layers = doc.get("layers") if isinstance(doc, dict) else None
        if not isinstance(layers, dict):
            raise InputError(f"{where} is not the expected JSON {{\"layers\": {{...}}}}.")
        for name, conf in layers.items():
            configs[name.rstrip(".") + "."] = _layer_config(conf, f"{where} layer {name!r}")
    for key, info in ckpt.tensors.items():
        if key.endswith(MARKER):
            if info.dtype != "U8" or len(info.shape) != 1 or info.numel > 65536:
                raise InputError(f"{ckpt.path}: {key!r} should be a small uint8 tensor of JSON, is {info.dtype} "
                                 f"{list(info.shape)}.")
            where = f"{ckpt.path}: {key!r}"
            conf = _layer_config(parse_json(read_bytes(info), str(ckpt.path), what=repr(key)), where)
            prefix = key[: -len(MARKER)] + "."
            declared = configs.get(prefix)
            if declared is not None and declared.get("format") != conf.get("format"):
                # two declarations of one layer that disagree: reading either would be a guess
                raise InputError(f"{where} says format {conf.get('format')!r}, the header metadata {METADATA_KEY} "
                                 f"says {declared.get('format')!r} for layer {prefix[:-1]!r}; flux-port will not "
                                 "guess which one the weights follow. Nothing was written.",
                                 hint="The file was edited or saved by two tools; re-save it with one.")
            configs[prefix] = conf
    return configs


def find(ckpt: Checkpoint) -> Found:
    found = Found(NAME, dropped_why="input_scale is ComfyUI's activation scale for quantized matmuls on capable "
                                    "GPUs; plain weights have no use for it (the port computes with unquantized "
                                    "activations, a slightly more precise function)")
    found.consumed.update(k for k in ckpt.tensors if k.endswith(MARKER))
    refused: dict[str, list[str]] = {}
    for prefix, conf in sorted(_configs(ckpt).items()):
        fmt = conf.get("format") if isinstance(conf, dict) else None
        if fmt in REFUSED or fmt not in SCHEMES:
            refused.setdefault(str(fmt), []).append(prefix[:-1])
            continue
        layer_parts(ckpt, prefix, SCHEMES[fmt], found, where=f"{NAME} {fmt}")
        if conf.get("full_precision_matrix_mult"):
            note = "some layers declare full_precision_matrix_mult (ComfyUI computed them unquantized)"
            if note not in found.notes:
                found.notes.append(note)
    if refused:
        fmt, layers = sorted(refused.items())[0]
        what = REFUSED.get(fmt, f"an unknown format {fmt!r}")
        raise UnsupportedQuantizationError(
            f"{ckpt.path}: {len(layers)} layer(s) are quantized as {NAME} {fmt!r}: {what} (e.g. {layers[0]!r}); "
            "flux-port refuses it: turning it into plain weights needs that format's exact inverse transform, "
            "which it does not implement. Nothing was written.",
            hint="Use an fp8, nvfp4, mxfp8, int8 or bf16 release of the same model.")
    return found


# `recognise`: the metadata, or a `<layer>.comfy_quant` tensor (a layer's, never a bare key)
LAYOUT = Layout(NAME, sidecars=(MARKER[1:], "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale"),
                markers=(MARKER[1:],), metadata_keys=(METADATA_KEY,), recognise=claims, find=find, refuses=REFUSED)
