"""SVDQuant layers turned into the weights the kernel multiplies by, a band of rows at a time.

    W = R·diag(1/s) + U·D        R: 4-bit codes times their scales (int4: one bf16 scale per 64 inputs; nvfp4:
                                 e2m1 times fp8 micro-scales per 16 inputs, times `wtscale` or `wcscales`)
    b = b_file (+ 0.171875·rowsum(R·diag(1/s)) for int4 GELU down-projections: the kernel's shift correction)

AWQ W4A16 adaLN layers: W = q·scale + zero, rows de-interleaved, and the +1 Nunchaku adds to the scale slots of the
bias taken off again. Everything is float32; the engine rounds once to the output dtype.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from porting.finite import check_scales
from porting.tensors.quant.svdq import tiles as P
from porting.tensors.quant.svdq.header import GELU_SHIFT, SvdqFile, SvdqLayer, Target
from porting.tensors.reader import read_stored

KEEP_LAYERS = 4  # unpacked scales and low-rank factors of this many recent layers stay cached


class UnpackedLayer:
    """One layer's small parts, unpacked once (scales, smoothing, low-rank factors, bias); codes read per band."""

    def __init__(self, layer: SvdqLayer) -> None:
        self.layer = layer
        parts = layer.parts
        n, k = layer.n, layer.k
        if layer.kind == "awq":
            self.whole = _awq_weight(layer)
            self.bias = _awq_bias(layer)
            return
        if layer.precision == "nvfp4":
            self.scales = P.unpack_micro_scales(read_stored(parts["wscales"]), n, k).float()
            self.group = 16
            row_scale = torch.ones(n)
            if "wtscale" in parts:
                row_scale = row_scale * read_stored(parts["wtscale"]).float().reshape(-1)[0]
            if "wcscales" in parts:
                row_scale = row_scale * P.unpack_vector(read_stored(parts["wcscales"])).float()
            self.row_scale = row_scale
        else:
            self.scales = P.unpack_scales(read_stored(parts["wscales"]), n, k // 64).float()
            self.group = 64
            self.row_scale = None
        self.smooth = (P.unpack_vector(read_stored(parts["smooth"])).float() if "smooth" in parts
                       else torch.ones(k))
        self._check(parts)
        if "lora_down" in parts:
            self.down = P.unpack_lowrank(read_stored(parts["lora_down"]), down=True)[:, :k].float()
            self.up = P.unpack_lowrank(read_stored(parts["lora_up"]), down=False)[:n].float()
        else:
            self.down = self.up = None
        self.file_bias = (P.unpack_vector(read_stored(parts["bias"])).float() if "bias" in parts
                          else torch.zeros(n))
        self._bias: torch.Tensor | None = None

    def _check(self, parts: dict) -> None:
        """Scales are checked as they are unpacked, by name: a NaN, a negative group scale or a zero smoothing
        factor (the kernel divides by it) would otherwise surface as a non-finite weight far from its cause."""
        check_scales(self.scales, repr(parts["wscales"].name), parts["wscales"].file, zero_ok=True)  # 0: zero group
        if "smooth" in parts:
            check_scales(self.smooth, repr(parts["smooth"].name), parts["smooth"].file)
        if self.row_scale is not None:
            role = "wcscales" if "wcscales" in parts else "wtscale"
            if role in parts:
                check_scales(self.row_scale, repr(parts[role].name), parts[role].file)

    def residual(self, a: int, b: int) -> torch.Tensor:
        """R·diag(1/s) for rows [a, b): the dequantized 4-bit part, unsmoothed."""
        layer = self.layer
        t0, t1 = a // P.TILE_N, -(-b // P.TILE_N)
        packed = read_stored(layer.parts["qweight"], (t0 * P.TILE_N, t1 * P.TILE_N))
        lo = a - t0 * P.TILE_N
        values = P.decode_values(packed, (t1 - t0) * P.TILE_N, layer.k, layer.precision)[lo:lo + b - a]
        r = values.view(b - a, -1, self.group).mul_(self.scales[a:b, :, None]).view(b - a, layer.k)
        if self.row_scale is not None:
            r.mul_(self.row_scale[a:b, None])
        return r.div_(self.smooth)

    def weight(self, a: int, b: int) -> torch.Tensor:
        if self.layer.kind == "awq":
            return self.whole[a:b]
        w = self.residual(a, b)
        if self.up is not None:
            w.addmm_(self.up[a:b], self.down)
        return w

    @property
    def bias(self) -> torch.Tensor:
        if self._bias is None:
            b = self.file_bias
            if self.layer.gelu_shift:
                rowsum = torch.cat([self.residual(a, min(a + 1024, self.layer.n)).sum(dim=1)
                                    for a in range(0, self.layer.n, 1024)])
                b = b + GELU_SHIFT * rowsum
            self._bias = b
        return self._bias

    @bias.setter
    def bias(self, value: torch.Tensor) -> None:
        self._bias = value


def _awq_weight(layer: SvdqLayer) -> torch.Tensor:
    n, k = layer.n, layer.k
    groups = k // 64
    codes = P.unpack_awq_codes(read_stored(layer.parts["qweight"]), n, k).float()
    scales = read_stored(layer.parts["wscales"])[:groups].float().t().repeat_interleave(64, dim=1)
    zeros = read_stored(layer.parts["wzeros"])[:groups].float().t().repeat_interleave(64, dim=1)
    return P.deinterleave_rows(codes.mul_(scales).add_(zeros), layer.awq_splits)


def _awq_bias(layer: SvdqLayer) -> torch.Tensor:
    s = layer.awq_splits
    if "bias" not in layer.parts:
        return torch.zeros(layer.n)
    if s <= 1:  # diffusers' layout: a plain linear, rows in order, the model adds the 1 itself
        return read_stored(layer.parts["bias"]).float().reshape(layer.n)
    b = read_stored(layer.parts["bias"]).float().reshape(layer.n // s, s).clone()
    for slot in {1, s - 2}:  # the scale slots (one slot when s = 3): Nunchaku runs adaLN with scale_shift 0
        b[:, slot] -= 1
    return b.t().reshape(layer.n)


class SvdqDecoder:
    """The checkpoint decoder for SVDQuant files: computes diffusers tensors from the stored layers."""

    def __init__(self, info: SvdqFile) -> None:
        self.info = info
        self._layers: OrderedDict[str, UnpackedLayer] = OrderedDict()

    def unpacked(self, layer: SvdqLayer) -> UnpackedLayer:
        hit = self._layers.get(layer.prefix)
        if hit is None:
            hit = UnpackedLayer(layer)
            self._layers[layer.prefix] = hit
            while len(self._layers) > KEEP_LAYERS:
                self._layers.popitem(last=False)
        else:
            self._layers.move_to_end(layer.prefix)
        return hit

    def dequantize(self, key: str, rows: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        target = self.info.targets[key]
        n = target.shape[0]
        a, b = rows or (0, n)
        out = self._bias(target)[a:b] if target.role == "bias" else self._weight(target, a, b)
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def _weight(self, target: Target, a: int, b: int) -> torch.Tensor:
        if target.join == "columns":
            return torch.cat([self.unpacked(p.layer).weight(p.rows[0] + a, p.rows[0] + b) for p in target.pieces],
                             dim=1)
        parts, offset = [], 0
        for p in target.pieces:
            size = p.rows[1] - p.rows[0]
            lo, hi = max(a, offset), min(b, offset + size)
            if lo < hi:
                start = p.rows[0] + lo - offset
                parts.append(self.unpacked(p.layer).weight(start, start + hi - lo))
            offset += size
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _bias(self, target: Target) -> torch.Tensor:
        biases = [self.unpacked(p.layer).bias[p.rows[0]:p.rows[1]] for p in target.pieces]
        if target.join == "columns":
            return torch.stack(biases).sum(dim=0)
        return torch.cat(biases)


__all__ = ["SvdqDecoder", "UnpackedLayer"]
