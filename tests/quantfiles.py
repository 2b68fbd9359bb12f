"""Tiny quantized checkpoints in the real layouts, made by independent producers, with their own dequantization.

Each builder quantizes the block linears of a reference model's state dict (as real releases do: embedders,
modulations and the final layer stay plain) with the producer's own quantizer (comfy-kitchen for ComfyUI layouts,
diffusers' BFL-scheme quantizer, the gguf package) and returns what to save plus the oracle: every tensor
dequantized by the producer's own code (float32). flux-port's readers are never used here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from safetensors.torch import save_file

State = dict[str, torch.Tensor]

COMFY_LAYOUTS = {  # ComfyUI format name -> comfy-kitchen layout class name and quantize kwargs
    "float8_e4m3fn": ("TensorCoreFP8Layout", {}),
    "float8_e5m2": ("TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}),
    "nvfp4": ("TensorCoreNVFP4Layout", {}),
    "mxfp8": ("TensorCoreMXFP8Layout", {}),
    "int8_tensorwise": ("TensorWiseINT8Layout", {}),
}


def block_linears(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if v.ndim == 2 and k.endswith(".weight")
            and k.startswith(("double_blocks.", "single_blocks."))]


def json_tensor(obj: object) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)


def _kitchen(w: torch.Tensor, fmt: str):
    from comfy_kitchen.tensor.base import QuantizedTensor

    layout, kwargs = COMFY_LAYOUTS[fmt]
    qt = QuantizedTensor.from_float(w.float().contiguous(), layout, **kwargs)
    return qt.state_dict("weight"), qt.dequantize().float()


def comfy_scaled_fp8(state: State, prefix: str = "model.diffusion_model.") -> tuple[State, State]:
    """ComfyUI legacy layout: fp8 weight + `scale_weight` (+ `scale_input`), marker `scaled_fp8`."""
    out, oracle = {}, {}
    quantized = set(block_linears(state))
    for key, w in state.items():
        if key in quantized:
            layer = key[: -len("weight")]
            sd, deq = _kitchen(w, "float8_e4m3fn")
            out[prefix + key] = sd["weight"]
            out[prefix + layer + "scale_weight"] = sd["weight_scale"]
            out[prefix + layer + "scale_input"] = torch.tensor(1.0)
            oracle[key] = deq
        else:
            out[prefix + key], oracle[key] = w, w.float()
    out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out, oracle


def comfy_mixed(state: State, fmt: str, declare: str = "tensor", pre_quant_scale: bool = False,
                input_scale: bool = True) -> tuple[State, State, dict[str, str]]:
    """ComfyUI mixed precision: comfy-kitchen's serialized layer plus a `comfy_quant` JSON tensor per layer
    (`declare="tensor"`) or the header's `_quantization_metadata` (`declare="metadata"`)."""
    out, oracle, layers = {}, {}, {}
    quantized = set(block_linears(state))
    gen = torch.Generator().manual_seed(11)
    for key, w in state.items():
        if key not in quantized:
            out[key], oracle[key] = w, w.float()
            continue
        layer = key[: -len(".weight")]
        sd, deq = _kitchen(w, fmt)
        for suffix, t in sd.items():
            out[f"{layer}.{suffix}"] = t
        if input_scale:
            out[f"{layer}.input_scale"] = torch.tensor(0.02)
        if pre_quant_scale:
            s = 0.5 + torch.rand(w.shape[1], generator=gen)
            out[f"{layer}.pre_quant_scale"] = s
            deq = deq * s[None, :]  # the layer computes W (x * s)
        conf = {"format": fmt}
        if declare == "tensor":
            out[f"{layer}.comfy_quant"] = json_tensor(conf)
        else:
            layers[layer] = conf
        oracle[key] = deq
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} if layers else {}
    return out, oracle, metadata


def _quantize_block_linears(state: State, quantize) -> tuple[State, State]:
    """BFL-named files: `quantize(key, w)` gives a block linear's saved tensors (suffix -> tensor, "weight" the
    weight itself) and its dequantized oracle; every other tensor is saved as it is."""
    out, oracle = {}, {}
    quantized = set(block_linears(state))
    for key, w in state.items():
        if key not in quantized:
            out[key], oracle[key] = w, w.float()
            continue
        saved, oracle[key] = quantize(key, w)
        layer = key[: -len("weight")]
        out.update({layer + suffix: t for suffix, t in saved.items()})
    return out, oracle


def bfl_fp8(state: State) -> tuple[State, State]:
    """BFL official fp8: fp8 linears with a per-tensor `weight_scale` (+ `input_scale`), BFL naming, no marker."""
    def quantize(key, w):
        sd, deq = _kitchen(w, "float8_e4m3fn")
        return {"weight": sd["weight"], "weight_scale": sd["weight_scale"], "input_scale": torch.tensor(0.01)}, deq

    return _quantize_block_linears(state, quantize)


def diffusers_bfl(state: State, nvfp4_single: bool = True) -> tuple[State, State]:
    """diffusers' BFL scheme (`quantizers/bfl/utils.py`): fp8r for double blocks, nvfp4 for single blocks."""
    from diffusers.quantizers.bfl import utils as bfl

    def quantize(key, w):
        if nvfp4_single and key.startswith("single_blocks."):
            q, s, s2 = bfl.quantize_nvfp4(w)
            return ({"weight": q, "weight_scale": s, "weight_scale_2": s2, "input_scale": torch.tensor(0.01)},
                    bfl.dequantize_nvfp4(q, s, s2).float())
        q, s = bfl.quantize_fp8r(w)
        return {"weight": q, "weight_scale": s}, bfl.dequantize_fp8r(q, s).float()

    return _quantize_block_linears(state, quantize)


def modelopt_int8(state: State) -> tuple[State, State]:
    """ModelOpt-style int8 W8A8: int8 weight, fp32 per-channel `weight_scale` [N], `input_scale`."""
    from comfy_kitchen.backends.eager.quantization import quantize_int8_rowwise

    def quantize(key, w):
        q, s = quantize_int8_rowwise(w.float())
        return {"weight": q, "weight_scale": s.reshape(-1), "input_scale": torch.tensor(0.05)}, q.float() * s

    return _quantize_block_linears(state, quantize)


def gguf_file(path: Path, state: State, qtype_name: str, arch: str = "flux") -> State:
    """A city96-style GGUF written with the gguf package: block linears in `qtype_name`, everything else F32.
    Returns the oracle (gguf's own dequantization)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    writer = gguf.GGUFWriter(str(path), arch)
    oracle = {}
    quantized = set(block_linears(state))
    for key, w in state.items():
        data = w.float().numpy()
        if key in quantized:
            q = gguf.quants.quantize(data, qtype)
            writer.add_tensor(key, q, raw_shape=q.shape, raw_dtype=qtype)
            oracle[key] = torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(data.shape).astype(np.float32))
        else:
            writer.add_tensor(key, data)
            oracle[key] = torch.from_numpy(data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return oracle


def save(path: Path, tensors: State, metadata: dict[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path
