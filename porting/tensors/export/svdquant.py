"""A Nunchaku SVDQuant file written from float weights, streaming: the header from known shapes, then one layer
quantized (`quant/svdq/quantize.py`), packed (`quant/svdq/tiles.py`) and written at a time.

`tensors` hands out diffusers-named weights (`get`) and is told when a tensor is no longer needed (`release`), so
only the tensors of the layer being quantized are in memory. The file's 16-bit tensors are written in bf16, as
Nunchaku's files hold them. The result records, per diffusers weight, the squared error of what the file holds and
of plain 4-bit rounding of the same group size, against the weight's squared norm.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Protocol

import torch

from porting.finite import check_tensor
from porting.tensors.quant.svdq import tiles as pack
from porting.tensors.quant.svdq.header import GELU_SHIFT
from porting.tensors.quant.svdq.layout import FileLayout, LayerPlan, Slice, padded
from porting.tensors.quant.svdq.quantize import quantize_awq, quantize_w4a4, rel, residual_amax, smoothing

from ..identity import WeightsHasher
from ..writer import Entry, write_shards

NAME = "Nunchaku SVDQuant"
HINT = "--quantize svdq-* needs finite weights; the source is damaged or from a diverged run."


class TensorSource(Protocol):
    def get(self, key: str) -> torch.Tensor: ...

    def release(self, key: str) -> None: ...


def kind_of(key: str) -> str:
    """A diffusers key with its block index as * (the rows of the quality table)."""
    return re.sub(r"^(\w+)\.\d+\.", r"\1.*.", key)


@dataclass
class Quality:
    """Per diffusers weight: [squared error of the file, of plain 4-bit rounding, squared norm], and its layer kind."""

    targets: dict[str, list[float]] = field(default_factory=dict)
    layer_kind: dict[str, str] = field(default_factory=dict)
    bias_sq: dict[str, float] = field(default_factory=dict)  # bias key -> squared norm of what the file stores

    @property
    def biases(self) -> dict[str, float]:
        return {k: math.sqrt(v) for k, v in self.bias_sq.items()}

    def add_bias(self, layer: LayerPlan, stored: torch.Tensor) -> None:
        row = 0
        for s in layer.bias:
            if isinstance(s, int):  # zeros where the model has no bias
                row += s
                continue
            m = s.rows[1] - s.rows[0] if s.rows else _rows(layer, s)
            self.bias_sq[s.key] = self.bias_sq.get(s.key, 0.0) + float(stored[row:row + m].double().pow(2).sum())
            row += m

    def add(self, key: str, kind: str, err: float, plain: float, norm: float) -> None:
        row = self.targets.setdefault(key, [0.0, 0.0, 0.0])
        row[0] += err
        row[1] += plain
        row[2] += norm
        self.layer_kind[key] = kind

    def by_kind(self) -> dict[str, dict[str, float | int | str]]:
        """Relative L2 errors per kind of weight: the file's, and plain rounding's of the same group size."""
        sums: dict[str, list[float]] = {}
        layers: dict[str, str] = {}
        for key, (err, plain, norm) in self.targets.items():
            kind = kind_of(key)
            row = sums.setdefault(kind, [0, 0.0, 0.0, 0.0])
            row[0] += 1
            row[1] += err
            row[2] += plain
            row[3] += norm
            layers[kind] = "W4A16 AWQ int4 g64" if self.layer_kind[key] == "awq" else "W4A4 + low-rank branch"
        return {kind: {"tensors": int(n), "layer": layers[kind], "rel_error": rel(err, norm),
                       "plain_rel_error": rel(plain, norm)} for kind, (n, err, plain, norm) in sums.items()}


def _rows(layer: LayerPlan, s: Slice) -> int:
    """Rows of `layer` that a whole-tensor weight or bias slice makes (a fused piece, or all of them)."""
    keys = [w.key.rsplit(".", 1)[0] for w in layer.weight]
    stem = s.key.rsplit(".", 1)[0]
    return layer.pieces[keys.index(stem)] if stem in keys and len(layer.pieces) > 1 else layer.n


def _slice(t: torch.Tensor, s: Slice) -> torch.Tensor:
    if s.rows is not None:
        t = t[s.rows[0]:s.rows[1]]
    if s.cols is not None:
        t = t[:, s.cols[0]:s.cols[1]]
    return t


def _weight(layer: LayerPlan, tensors: TensorSource, where: str) -> torch.Tensor:
    parts = [_slice(tensors.get(s.key), s) for s in layer.weight]
    w = torch.cat([p.float() for p in parts]) if len(parts) > 1 else parts[0].to(torch.float32, copy=True)
    check_tensor(w, f"layer {layer.name} (from {', '.join(s.key for s in layer.weight)}) cannot be quantized: it",
                 where, into=torch.bfloat16, hint=HINT)
    return w


def _bias(layer: LayerPlan, tensors: TensorSource) -> torch.Tensor:
    parts = [torch.zeros(s) if isinstance(s, int) else _slice(tensors.get(s.key), s).float() for s in layer.bias]
    return torch.cat(parts)


def input_maxima(layer: LayerPlan, maxima: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The calibrated input maxima of a stored layer: those of the diffusers linear it reads the input of (the
    columns it takes of a column-joined one)."""
    first = layer.weight[0]
    x = maxima[first.key[: -len(".weight")]]
    return x[first.cols[0]:first.cols[1]] if first.cols else x


@dataclass
class _Shared:
    """What layers made of one diffusers linear share: its smoothing (rows), its nvfp4 amax (columns)."""

    siblings: dict[str, list[LayerPlan]]  # diffusers key -> the layers made of its columns
    smooths: dict[str, torch.Tensor] = field(default_factory=dict)
    amax: dict[str, float] = field(default_factory=dict)


def shared_smoothing(layer: LayerPlan, tensors: TensorSource, maxima: Mapping[str, torch.Tensor] | None,
                     cache: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """One smoothing for every layer made of rows of one diffusers linear (FLUX.2's single-block qkv_proj and
    mlp_fc1 of `to_qkv_mlp_proj`: they read the same input), computed from the whole linear, so the layers join
    back into that linear exactly (diffusers' layout, `quant/svdq/relayout.py`); None for any other layer."""
    if len(layer.weight) != 1 or layer.weight[0].rows is None:
        return None
    key = layer.weight[0].key
    if key not in cache:
        whole = tensors.get(key)
        x = maxima[key[: -len(".weight")]] if maxima else None
        cache[key] = smoothing(whole, x)
    return cache[key]


def shared_amax(layer: LayerPlan, siblings: list[LayerPlan], tensors: TensorSource, rank: int,
                maxima: Mapping[str, torch.Tensor] | None, cache: dict[str, float], where: str) -> float | None:
    """nvfp4: one per-tensor scale for every layer made of columns of one diffusers linear (the single block's
    out_proj and mlp_fc2), the largest value any of them may round (`quantize.residual_amax`); None otherwise."""
    if len(layer.weight) != 1 or layer.weight[0].cols is None:
        return None
    key = layer.weight[0].key
    if key not in cache:
        cache[key] = max(residual_amax(_weight(s, tensors, where), rank, x_max=input_maxima(s, maxima) if maxima
                                       else None) for s in siblings)
    return cache[key]


def _w4a4(layer: LayerPlan, precision: str, rank: int, tensors: TensorSource, quality: Quality, where: str,
          maxima: Mapping[str, torch.Tensor] | None, shared: _Shared) -> Iterator[torch.Tensor]:
    smooth = shared_smoothing(layer, tensors, maxima, shared.smooths)
    amax = (shared_amax(layer, shared.siblings.get(layer.weight[0].key, []), tensors, rank, maxima, shared.amax,
                        where) if precision == "nvfp4" else None)
    w = _weight(layer, tensors, where)
    q = quantize_w4a4(w, precision, rank, list(layer.pieces), x_max=input_maxima(layer, maxima) if maxima else None,
                      smooth=smooth, amax=amax)
    del w
    _record(layer, q.errors, quality, "w4a4")
    yield pack.pack_codes(q.codes)
    if precision == "int4":
        yield pack.pack_scales(q.scales)
    else:
        assert q.tensor_scales is not None
        if len(layer.pieces) > 1:
            rows = torch.cat([q.tensor_scales[i:i + 1].expand(m) for i, m in enumerate(layer.pieces)])
            yield pack.pack_vector(rows)
        else:
            yield q.tensor_scales.clone()
        yield pack.pack_micro_scales(q.scales)
    if layer.bias:
        b = _bias(layer, tensors)
        if layer.gelu_shift and precision == "int4":  # the kernel adds 0.171875 · rowsum(R/s) back (svdq/decode)
            b = b - GELU_SHIFT * q.residual_rowsum
        check_tensor(b, f"the bias of layer {layer.name}", where, into=torch.bfloat16, hint=HINT)
        stored = b.to(torch.bfloat16)
        quality.add_bias(layer, stored.float())
        yield pack.pack_vector(stored)
    s = pack.pack_vector(q.smooth)
    yield s
    yield s.clone()
    r = padded(rank)
    for t, down in ((q.down, True), (q.up, False)):
        check_tensor(t, f"the low-rank branch of layer {layer.name}", where, hint=HINT)
        yield pack.pack_lowrank(pack.pad_rank(t, r, 0 if down else 1), down)


def _awq(layer: LayerPlan, tensors: TensorSource, quality: Quality, where: str) -> Iterator[torch.Tensor]:
    w = _weight(layer, tensors, where)
    q = quantize_awq(w)
    del w
    _record(layer, q.errors, quality, "awq")
    splits = layer.awq_splits
    yield pack.pack_awq_codes(pack.interleave_rows(q.codes, splits))
    yield pack.interleave_rows(q.scales, splits).t().contiguous()
    yield pack.interleave_rows(q.zeros, splits).t().contiguous()
    b = _bias(layer, tensors).to(torch.bfloat16).view(splits, layer.n // splits)
    delta = torch.zeros(splits, 1, dtype=torch.bfloat16)
    delta[1] = delta[splits - 2] = 1  # Nunchaku runs adaLN with scale_shift 0: +1 on the scale slots, in bf16
    stored = b + delta
    quality.add_bias(layer, stored.reshape(layer.n).float())
    yield stored.t().reshape(layer.n).contiguous()


def _record(layer: LayerPlan, errors, quality: Quality, kind: str) -> None:
    row = 0
    for i, s in enumerate(layer.weight):
        m = s.rows[1] - s.rows[0] if s.rows else (layer.n if s.cols else layer.pieces[i])
        quality.add(s.key, kind, float(errors.quantized[row:row + m].sum()), float(errors.plain[row:row + m].sum()),
                    float(errors.norm[row:row + m].sum()))
        row += m


def write(path: Path, layout: FileLayout, precision: str, rank: int, tensors: TensorSource,
          metadata: Mapping[str, str], where: str, maxima: Mapping[str, torch.Tensor] | None = None) -> Quality:
    """Write the whole file at `path`; `where` names the source in errors; `maxima`: calibrated input maxima per
    diffusers module (None: data-free smoothing)."""
    specs = layout.entries(precision, rank)
    entries = [Entry(key, shape, dtype) for key, shape, dtype in specs]
    quality = Quality()
    siblings: dict[str, list[LayerPlan]] = {}
    for layer in layout.layers:
        if len(layer.weight) == 1 and layer.weight[0].cols is not None:
            siblings.setdefault(layer.weight[0].key, []).append(layer)
    shared = _Shared(siblings)
    last: dict[str, int] = {}
    for i, layer in enumerate(layout.layers):
        for key in layer.sources:
            last[key] = i

    def items() -> Iterator[torch.Tensor]:
        for _, key, _ in layout.plain:
            t = tensors.get(key)
            check_tensor(t, key, where, into=torch.bfloat16, hint=HINT)
            yield t.to(torch.bfloat16).contiguous()
            tensors.release(key)
        for i, layer in enumerate(layout.layers):
            if layer.kind == "awq":
                yield from _awq(layer, tensors, quality, where)
            else:
                yield from _w4a4(layer, precision, rank, tensors, quality, where, maxima, shared)
            for key in layer.sources:
                if last[key] == i:
                    tensors.release(key)

    write_shards(path.parent, path.name[: -len(".safetensors")], entries, items(), max_shard_bytes=2**62,
                 metadata=dict(metadata), hasher=WeightsHasher())  # its identity kept: validate reads no tensor
    return quality


__all__ = ["NAME", "TensorSource", "Quality", "kind_of", "write"]
