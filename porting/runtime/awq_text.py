"""A 4-bit text encoder (Nunchaku's AWQ W4A16 Qwen3 or T5) run with its linears kept packed, in plain torch on any
device: `AwqLinear` holds the codes two to a byte in the logical order (a quarter of bf16's bytes) with the group
scales and zeros, and dequantizes its weight in one vectorized pass per call, W = q * scales + scaled_zeros in
float32 rounded once to the compute dtype, then multiplies. Its numbers are the bf16 folder's that `port convert`
writes from the same file (the same weights, the same matmul).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from porting.errors import InputError
from porting.skeleton import empty_weights

BAND = 64  # rows dequantized at a time: 64 x 4096 inputs of float32 scratch is 1 MiB


class AwqLinear(nn.Module):
    """y = x W^T (+ b), W [n, k] stored as 4-bit codes with one scale and zero point per (group, output row)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        n, k = codes.shape
        self.in_features, self.out_features, self.group, self.dtype = k, n, group, dtype
        pairs = codes.to(torch.uint8).reshape(n, k // 2, 2)
        self.register_buffer("packed", pairs[..., 0] | (pairs[..., 1] << 4))  # [n, k/2]: low nibble first
        self.register_buffer("scales", scales.t().contiguous())  # [n, groups]
        self.register_buffer("zeros", zeros.t().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """An empty tensor of the compute dtype: what models that read `linear.weight.dtype` (T5's feed-forward
        casts its input to it) need to know; the weight itself is `weight_rows()`."""
        return torch.empty(0, dtype=self.dtype, device=self.packed.device)

    def weight_rows(self) -> torch.Tensor:
        """The dequantized weight [n, k] in the compute dtype, made BAND rows at a time so that each band's float32
        scratch stays in the CPU cache (one pass over the codes; the same numbers as dequantizing it whole)."""
        n, k, g = self.out_features, self.in_features, self.group
        out = torch.empty(n, k, dtype=self.dtype, device=self.packed.device)
        scratch = torch.empty(min(BAND, n), k // 2, 2, dtype=torch.float32, device=self.packed.device)
        scales, zeros = self.scales.float().unsqueeze(2), self.zeros.float().unsqueeze(2)
        for a in range(0, n, BAND):
            b = min(a + BAND, n)
            codes, v = self.packed[a:b], scratch[: b - a]
            v[..., 0].copy_(codes & 0xF)
            v[..., 1].copy_(codes >> 4)
            w = v.view(b - a, k // g, g)
            out[a:b].copy_(w.mul_(scales[a:b]).add_(zeros[a:b]).view(b - a, k))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.dtype), self.weight_rows(), self.bias)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def load_packed_text_encoder(path: Any, device: str | torch.device = "cpu",
                             dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The text encoder of a 4-bit file (or its opened `porting.inputs.Source`), its 4-bit linears `AwqLinear`, the
    rest in `dtype`, on `device`."""
    import transformers

    from porting.inputs import as_source
    from porting.tensors.quant.svdq.tiles import unpack_awq_codes

    source = as_source(path, kind="text_encoder")
    encoder = source.text_encoder
    if not encoder.quantized or encoder.group is None:
        raise InputError(f"{source.path}: not a 4-bit text encoder (no AWQ W4A16 layer).",
                         hint="Load a bf16 text encoder folder with its transformers class.")
    arch = encoder.architecture
    config = getattr(transformers, arch.config_class)(**{k: v for k, v in encoder.config.items()
                                                         if k not in ("architectures", "model_type")})
    with warnings.catch_warnings(), empty_weights():
        warnings.simplefilter("ignore")
        model = getattr(transformers, arch.model_class)(config)
    stored, view = source.view.stored_tensors, source.view
    g = encoder.group
    for name in encoder.quantized:
        n, k = stored[name + ".qweight"].shape[0] * 4, stored[name + ".qweight"].shape[1]
        codes = unpack_awq_codes(_stored(view, name + ".qweight"), n, k)
        scales = _stored(view, name + ".scales")[: k // g].to(dtype)
        zeros = _stored(view, name + ".scaled_zeros")[: k // g].to(dtype)
        bias = _stored(view, name + ".bias") if name + ".bias" in stored else None
        _replace(model, name, AwqLinear(codes, scales, zeros, g, bias, dtype).to(device))
    # the 16-bit tensors take the places of the meta parameters (the computed buffers, rotary tables, are kept)
    state = {k: view.read(k, dtype=dtype) for k, info in view.tensors.items() if not info.computed}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith((".packed", ".scales", ".zeros"))
               and m != "encoder.embed_tokens.weight"]  # T5's encoder embedding is the shared one
    if missing or unexpected:
        raise InputError(f"{source.path}: the file does not make a {arch.model_class} of its config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}).")
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise InputError(f"{source.path}: {left[0]!r} is not in the file.")
    return model.to(device).eval().requires_grad_(False)


def _stored(view: Any, key: str) -> torch.Tensor:
    from porting.tensors.reader import read_stored

    return read_stored(view.stored_tensors[key])


__all__ = ["AwqLinear", "load_packed_text_encoder"]
