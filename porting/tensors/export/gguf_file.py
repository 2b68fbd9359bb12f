"""GGUF as city96's ComfyUI-GGUF loader expects it: `general.architecture = "flux"`, BFL names without prefix.

Quantized with the gguf package's own quantizer (`gguf.quants.quantize`: Q8_0, Q4_0, ...); 1-D and small tensors
in F32, other unquantized tensors in BF16 / F16 / F32 as the output dtype says. Streaming: tensor infos first from
known shapes, then the data one tensor at a time (`GGUFWriter.write_tensor_data`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from porting.errors import InputError
from porting.finite import NotFinite, check_tensor, peak

from . import quantizable

ARCH = "flux"
PLAIN = {"BF16": "BF16", "F16": "F16", "F32": "F32"}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as e:
        raise InputError("writing GGUF files needs the gguf package.", hint="pip install 'flux-port[quant]'") from e
    return gguf


def kinds(specs: list[tuple[str, tuple[int, ...]]], qtype_name: str, plain: str) -> dict[str, str]:
    gguf = _gguf()
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]]
    out = {}
    for key, shape in specs:
        if len(shape) < 2 or shape[0] * shape[-1] <= 1024:
            out[key] = "F32"
        elif quantizable(key, shape, block):
            out[key] = qtype_name
        else:
            out[key] = PLAIN.get(plain, "F16")
    return out


def write(path: Path, specs: list[tuple[str, tuple[int, ...]]], tensors: Iterable[torch.Tensor], qtype_name: str,
          plain: str) -> dict[str, str]:
    import numpy as np

    gguf = _gguf()
    types = kinds(specs, qtype_name, plain)
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, shape in specs:
        qtype = gguf.GGMLQuantizationType[types[key]]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor_info(key, shape, np.dtype(np.float32), 4 * _numel(shape))
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(key, byte_shape, np.dtype(np.uint8), _numel(byte_shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (key, _), t in zip(specs, tensors):
        qtype = gguf.GGMLQuantizationType[types[key]]
        check_fits(key, t, types[key])
        data = t.float().contiguous().numpy()
        writer.write_tensor_data(data if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(data, qtype))
    writer.close()
    return types


# the gguf quantizer's block scale is |largest value| / CODES, stored as fp16
CODES = {"Q8_0": 127, "Q4_0": 8}
FP16_MAX = 65504.0


def check_fits(key: str, t: torch.Tensor, kind: str) -> None:
    """Refuse a tensor whose stored form would not be finite: a plain cast beyond its dtype, or a block scale
    beyond fp16 (Q8_0: |value| above 127 x 65504)."""
    if kind in CODES:
        top = peak(t)
        if top > CODES[kind] * FP16_MAX:
            raise NotFinite(f"layer {key}: |value| up to {top:.6g}; {kind} stores each block's scale (|largest| / "
                            f"{CODES[kind]}) as fp16, whose largest is {FP16_MAX:g}, so the scale would be infinite. "
                            "Nothing was written.", hint="Use --quantize fp8-scaled (fp32 scales) for this model.")
    elif kind in ("BF16", "F16"):
        check_tensor(t, f"layer {key}", None, into=torch.bfloat16 if kind == "BF16" else torch.float16)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
