"""`SvdqLinear`: one diffusers linear computed from Nunchaku SVDQuant parts kept packed, in plain torch.

A diffusers linear is made of pieces (`porting.tensors.quant.svdq.reader.Target`): rows [a, b) of a stored layer (q, k
or v of a fused qkv), several layers whose outputs are stacked (FLUX.2's single-block qkv + mlp), or several layers
that read consecutive input columns and whose outputs add (the single block's out + mlp down-projection). Each
piece keeps its part of the file packed (`PackedPiece`): 4-bit codes two per byte in plain row-major order (the
MMA tile permutation is undone once, at load), the group scales as stored (bf16 per 64 inputs, or e4m3 per 16 plus
the per-tensor `wtscale` and per-channel `wcscales`), the smoothing s, the low-rank factors D (r, k) and U (n, r),
the bias. That is about a third of the bf16 weight.

`compute="w4a4"` runs what the Nunchaku kernel computes (`svdq_act`; docs/quantized.md, "Running SVDQuant files as
they are"): the low-rank branch on the raw input, the 4-bit branch on the input divided by s and rounded to 4 bits
per group, multiplied by the 4-bit weights and accumulated in float32 (the kernel accumulates int4 groups in T:
about 1 % apart for bf16), then the bias, then the low-rank output. `compute="w4a16"` multiplies the full-precision
input by the dequantized weight R/s + U·D (what `port convert` writes), computed as (x/s)·Rᵀ + (x·Dᵀ)·Uᵀ so that
only R is ever dequantized. Either way R is dequantized a cache-sized band of rows at a time while the forward runs
(on an accelerator, the whole weight at once), in one vectorized pass over the band's bytes and its scales, and
multiplied at once: memory stays packed. AWQ W4A16 layers (FLUX.1 adaLN) are plain linears with dequantized weights.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from porting.tensors.quant.svdq import tiles as P
from porting.tensors.quant.svdq.decode import SvdqDecoder, _awq_bias
from porting.tensors.quant.svdq.reader import SvdqLayer, Target
from porting.tensors.reader import read_stored

from .svdq_act import SHIFT_GELU, int4_activations, nvfp4_activations, round_to, smoothed

COMPUTES = ("w4a4", "w4a16")
BAND_ELEMENTS = 1 << 22  # float32 elements of weight dequantized at once (16 MiB: stays in cache while it is used)
FP16_MAX = 65504.0


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(rows, k) 4-bit codes 0..15 -> (rows, k/2) uint8, column 2j in the low nibble, 2j+1 in the high one."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: (rows, k/2) uint8 -> (rows, k) uint8 codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


class PackedPiece(nn.Module):
    """Rows [a, b) of one stored layer, packed; `forward(x, compute)` maps (tokens, k) to (tokens, b - a)."""

    def __init__(self, layer: SvdqLayer, rows: tuple[int, int], decoder: SvdqDecoder, with_bias: bool) -> None:
        super().__init__()
        a, b = rows
        self.prefix, self.kind, self.precision = layer.prefix, layer.kind, layer.precision
        self.k, self.n = layer.k, b - a
        self.gelu_shift = layer.gelu_shift
        self.alpha = 1.0
        buf = self._buffer
        for name in ("wcscales", "zeros", "bias_w4a16"):
            buf(name, None)
        if layer.kind == "awq":
            self._load_awq(layer, rows, with_bias)
            return
        unpacked = decoder.unpacked(layer)
        t0, t1 = a // P.TILE_N, -(-b // P.TILE_N)
        stored = read_stored(layer.parts["qweight"], (t0 * P.TILE_N, t1 * P.TILE_N))
        lo = a - t0 * P.TILE_N
        buf("codes", P.unpack_code_bytes(stored, (t1 - t0) * P.TILE_N, layer.k)[lo:lo + b - a].contiguous())
        if layer.precision == "nvfp4":
            buf("scales", unpacked.scales[a:b].to(torch.float8_e4m3fn).view(torch.uint8))  # e4m3 bits
            if "wtscale" in layer.parts:
                self.alpha = float(read_stored(layer.parts["wtscale"]).float().reshape(-1)[0])
            buf("wcscales", P.unpack_vector(read_stored(layer.parts["wcscales"]))[a:b]
                if "wcscales" in layer.parts else None)
        else:
            buf("scales", unpacked.scales[a:b].to(layer.parts["wscales"].torch_dtype))
        stored_dtype = layer.parts["smooth"].torch_dtype if "smooth" in layer.parts else torch.bfloat16
        buf("smooth", unpacked.smooth.to(stored_dtype))
        if unpacked.down is not None:
            buf("down", unpacked.down.to(layer.parts["lora_down"].torch_dtype))
            buf("up", unpacked.up[a:b].to(layer.parts["lora_up"].torch_dtype))
        else:
            buf("down", None)
            buf("up", None)
        buf("bias", unpacked.file_bias[a:b].clone() if with_bias else None)
        # w4a16 multiplies u, not u + shift: its bias carries the kernel's shift correction (quant/svdq/decode.py)
        buf("bias_w4a16", unpacked.bias[a:b].clone() if with_bias and layer.gelu_shift else None)

    def _buffer(self, name: str, value: torch.Tensor | None) -> None:
        self.register_buffer(name, value, persistent=False)  # not weights a state dict could save or load

    def _load_awq(self, layer: SvdqLayer, rows: tuple[int, int], with_bias: bool) -> None:
        a, b = rows
        n, k, splits = layer.n, layer.k, layer.awq_splits
        groups = k // 64
        codes = P.deinterleave_rows(P.unpack_awq_codes(read_stored(layer.parts["qweight"]), n, k), splits)
        self._buffer("codes", pack_nibbles(codes[a:b]))
        for role, name in (("wscales", "scales"), ("wzeros", "zeros")):
            t = read_stored(layer.parts[role])[:groups].t()
            self._buffer(name, P.deinterleave_rows(t, splits)[a:b].contiguous())
        self._buffer("bias", _awq_bias(layer)[a:b].clone() if with_bias else None)
        for name in ("smooth", "down", "up", "wcscales", "bias_w4a16"):
            self._buffer(name, None)

    # -- the weight, a band of rows at a time ---------------------------------------------------------------------

    def values(self, r0: int, r1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [r0, r1) of the 4-bit weight times its group scales (no wtscale, wcscales, s or U·D; AWQ:
        q·scale + zero), float32, or these float32 values rounded to `dtype`. One vectorized pass over the band's
        bytes (`tiles.*_band_values`), no lookup; bf16 directly (half the traffic) where that rounds the same."""
        if self.kind == "awq":
            return P.awq_band_values(self.codes[r0:r1], self.scales[r0:r1], self.zeros[r0:r1]).to(dtype)
        direct = dtype if dtype == torch.bfloat16 and self.scales.dtype in (torch.bfloat16, torch.uint8) else None
        if self.precision == "nvfp4":
            v = P.nvfp4_band_values(self.codes[r0:r1], self.scales[r0:r1].view(torch.float8_e4m3fn),
                                    direct or torch.float32)
        else:
            v = P.int4_band_values(self.codes[r0:r1], self.scales[r0:r1], direct or torch.float32)
        return v.to(dtype)

    def weight(self, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the effective weight R/s + U·D, float32 (what svdq/decode.py dequantizes)."""
        w = self.values(r0, r1)
        if self.kind == "awq":
            return w
        if self.precision == "nvfp4":
            w = w * self.alpha
            if self.wcscales is not None:
                w = w * self.wcscales[r0:r1, None].float()
        w = w / self.smooth.float()
        if self.up is not None:
            w = w + self.up[r0:r1].float() @ self.down.float()
        return w

    def row_scale(self) -> torch.Tensor:
        """nvfp4's per-output factor alpha·wcscales, float32 (n,)."""
        scale = torch.full((self.n,), self.alpha, dtype=torch.float32, device=self.codes.device)
        return scale * self.wcscales.float() if self.wcscales is not None else scale

    def bands(self) -> list[tuple[int, int]]:
        if self.codes.device.type != "cpu":  # an accelerator's cost is per launch, not per cache miss: one band
            return [(0, self.n)]
        step = max(16, BAND_ELEMENTS // self.k)
        return [(r, min(r + step, self.n)) for r in range(0, self.n, step)]

    def product(self, h: torch.Tensor) -> torch.Tensor:
        """h (tokens, k) times the 4-bit weight's transpose (`values`), in h's dtype, a cache-sized band of weight
        rows at a time: (tokens, n)."""
        out = torch.empty(h.shape[0], self.n, dtype=h.dtype, device=h.device)
        for r0, r1 in self.bands():
            out[:, r0:r1] = h @ self.values(r0, r1, h.dtype).t()
        return out

    # -- forward --------------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, compute: str = "w4a4", act_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`act_dtype`: the T the kernel rounds to, when the run computes in float32 but stores another dtype
        (validate's emulated intrinsic run); default x.dtype."""
        if compute == "w4a16" or self.kind == "awq":
            return self._w4a16(x)
        return self._w4a4(x, act_dtype or x.dtype)

    def _w4a16(self, x: torch.Tensor) -> torch.Tensor:
        """x·(R/s + U·D)ᵀ + b computed as (x/s)·Rᵀ + (x·Dᵀ)·Uᵀ + b: the weight's effective form is never built,
        only R a band at a time; equal to the converted folder up to its bf16 rounding."""
        bias = self.bias_w4a16 if self.bias_w4a16 is not None else self.bias
        flat = x.reshape(-1, self.k)
        if self.kind == "awq":
            out = self.product(flat)
            out = out.add_(bias.to(out.dtype)) if bias is not None else out
            return out.reshape(*x.shape[:-1], self.n)
        h = (flat.float() / self.smooth.float()).to(x.dtype)
        out = self.product(h).float()
        if self.precision == "nvfp4":
            out.mul_(self.row_scale())
        if self.up is not None:
            out.addmm_(flat.float() @ self.down.float().t(), self.up.float().t())
        if bias is not None:
            out.add_(bias.float())
        return out.to(x.dtype).reshape(*x.shape[:-1], self.n)

    def _w4a4(self, x: torch.Tensor, t: torch.dtype) -> torch.Tensor:
        lora = x.float() @ self.down.float().t() if self.down is not None else None  # raw input, before s and shift
        h = smoothed(x, self.smooth, SHIFT_GELU if self.gelu_shift else 0.0, t)
        act = nvfp4_activations(h) if self.precision == "nvfp4" else int4_activations(h, t, self.gelu_shift)
        acc = self.product(act.reshape(-1, self.k)).reshape(*x.shape[:-1], self.n)
        if self.alpha != 1.0:
            acc = acc * self.alpha
        acc = round_to(acc, t)
        if self.wcscales is not None or self.bias is not None:  # one rounding of acc·wc + b (EpilogueBias)
            if self.wcscales is not None:
                acc = acc * self.wcscales.float()
            if self.bias is not None:
                acc = acc + self.bias.float()
            acc = round_to(acc, t)
        if lora is not None:
            acc = acc + round_to(lora, t) @ self.up.float().t()
        if t == torch.float16:
            acc = acc.clamp(-FP16_MAX, FP16_MAX)
        return acc.to(x.dtype)

    def packed_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        shift = ", GELU-shifted unsigned input" if self.gelu_shift else ""
        return f"{self.prefix[:-1]}: {self.n} x {self.k}, {self.kind} {self.precision}{shift}"


class SvdqLinear(nn.Module):
    """A diffusers nn.Linear made of packed SVDQuant pieces; `compute` is "w4a4" (the kernel's) or "w4a16"."""

    def __init__(self, pieces: Sequence[PackedPiece], join: str, compute: str = "w4a4") -> None:
        super().__init__()
        if compute not in COMPUTES:
            raise ValueError(f"compute {compute!r}: one of {', '.join(COMPUTES)}")
        self.pieces = nn.ModuleList(pieces)
        self.join = join
        self.compute = compute
        self.act_dtype: torch.dtype | None = None  # the kernel's T when it is not the input's dtype
        if join == "columns":
            self.in_features, self.out_features = sum(p.k for p in pieces), pieces[0].n
        else:
            self.in_features, self.out_features = pieces[0].k, sum(p.n for p in pieces)

    @classmethod
    def from_target(cls, weight: Target, bias: Target | None, decoder: SvdqDecoder,
                    compute: str = "w4a4") -> SvdqLinear:
        pieces = [PackedPiece(p.layer, p.rows, decoder, with_bias=bias is not None) for p in weight.pieces]
        return cls(pieces, weight.join, compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.join == "columns":  # each layer reads its own input columns; the outputs add (in T)
            out, start = None, 0
            for p in self.pieces:
                y = p(flat[:, start:start + p.k], self.compute, self.act_dtype)
                out, start = (y if out is None else out + y), start + p.k
        else:
            outs = [p(flat, self.compute, self.act_dtype) for p in self.pieces]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out.reshape(*x.shape[:-1], self.out_features)

    def packed_bytes(self) -> int:
        return sum(p.packed_bytes() for p in self.pieces)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compute={self.compute}"


__all__ = ["COMPUTES", "PackedPiece", "SvdqLinear", "pack_nibbles", "unpack_nibbles"]
