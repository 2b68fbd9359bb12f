"""`port merge SVDQ_FILE ADAPTER...`: adapters added to a Nunchaku SVDQuant file's low-rank branches, exactly.

The branch runs on the raw input in 16 bits (y = Q4(x/s)·R^T + x·D^T·U^T), so a delta U'·D' is merged by
appending U' to `proj_up` and D' to `proj_down`: nothing is requantized, and the merged file computes
W + U'·D' (to the bf16 rounding of the appended factors). Per adapter module:

- a LoRA whose module is a diffusers tensor of the file: its own factors (up x strength x alpha/rank, down), placed
  on the rows or columns of the stored layer that tensor is part of;
- anything else (LoKr, LoHa, full / `.diff` deltas, a LoRA in another naming carried through a table step): the
  dense delta of each stored layer, factorised by SVD to the smallest rank whose relative error is at most
  `max_error` (a delta of low rank comes out exact to float32 rounding; the error of each layer is reported);
- a delta on a W4A16 (AWQ adaLN) layer, which has no branch: folded in and that layer alone requantized (reported);
- a delta on a 16-bit tensor (embedders, norms, modulation): added as `port merge` adds it to any weight.

Every layer's branch is padded with zeros to one common rank, a multiple of 16 (`quantization_config.rank` says
it); every other stored tensor is copied byte for byte. `requantize=True` instead folds the deltas into the
dequantized weights and writes a new data-free SVDQuant file at the base's rank (`port convert --quantize svdq-*`).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch

from porting import __version__
from porting.engine.convert import MANIFEST, ConvertResult, plan_source
from porting.errors import UsageError
from porting.finite import check_tensor, dumps
from porting.inputs import Source
from porting.inputs.adapter_keys import Adapter, ModuleAdapter
from porting.outputs import atomic_folder, check_output
from porting.tensors.checkpoint import ST_TO_TORCH
from porting.tensors.identity import WeightsHasher
from porting.tensors.quant.svdq import tiles as P
from porting.tensors.quant.svdq import tiles as pack
from porting.tensors.quant.svdq.decode import SvdqDecoder, UnpackedLayer
from porting.tensors.quant.svdq.header import SvdqFile, SvdqLayer, Target
from porting.tensors.quant.svdq.layout import padded
from porting.tensors.quant.svdq.quantize import FULL_SVD_MAX, quantize_awq, top_singular
from porting.tensors.quant.svdq.reader import svdq_info, table
from porting.tensors.reader import TensorInfo, read_stored
from porting.tensors.writer import Entry, Segments, write_shards

from .delta import multiplier, rank, read32

MAX_ERROR = 1e-3
SUM_HINT = "Lower the adapter's strength, or merge into a bf16 / fp32 copy of the base."
Contribution = tuple[Adapter, ModuleAdapter, float]
# the whole float32 delta of one part of a `Placement`, handed in by merge.py
DeltaOf = Callable[[Any, str], torch.Tensor]


class Placement(Protocol):
    """What this module uses of merge.py's `Placement` (where each delta lands), which is built there: merge.py
    imports this module, so importing it back would be a cycle."""

    @property
    def direct(self) -> Mapping[str, Any]: ...

    @property
    def via(self) -> Mapping[str, Any]: ...

    def __contains__(self, param: str) -> bool: ...

    def names(self, param: str) -> str: ...

    def pop(self, param: str) -> list[Any]: ...

    def add_into(self, param: str, weight: torch.Tensor) -> None: ...


@dataclass
class _Layer:
    """What is added to one stored layer: LoRA factors (read when the layer is written) and dense factors."""

    layer: SvdqLayer
    loras: list[tuple[Target, Contribution]] = field(default_factory=list)
    dense: torch.Tensor | None = None  # float32 (n, k) sum of the non-LoRA deltas
    dense_factors: tuple[torch.Tensor, torch.Tensor] | None = None
    error: float = 0.0  # relative error of the dense factorisation
    names: set[str] = field(default_factory=set)

    @property
    def added_rank(self) -> int:
        lora = sum(rank(a, m) or 0 for _, (a, m, _) in self.loras)
        return lora + (self.dense_factors[0].shape[1] if self.dense_factors is not None else 0)


def _rows_cols(target: Target, layer_prefix: str) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(target rows, target columns) the piece of `layer_prefix` takes, and the layer rows they land on."""
    off = 0
    for p in target.pieces:
        size = p.rows[1] - p.rows[0] if target.join == "rows" else p.layer.k
        if p.layer.prefix == layer_prefix:
            if target.join == "rows":
                return (off, off + size), (0, p.layer.k), p.rows
            return (0, p.layer.n), (off, off + size), (0, p.layer.n)
        off += size
    raise KeyError(layer_prefix)


def factorise(delta: torch.Tensor, max_error: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(U (n, r), D (r, k), relative error) with r the smallest rank whose error is at most `max_error`."""
    n, k = delta.shape
    total = float(delta.double().pow(2).sum())
    if total == 0:
        return delta.new_zeros(n, 0), delta.new_zeros(0, k), 0.0
    q = min(n, k) if min(n, k) <= FULL_SVD_MAX else 64
    while True:
        u, d = top_singular(delta, q)  # singular values split evenly: |u_i| = |d_i| = sqrt(sigma_i)
        sigma2 = (u.double().pow(2).sum(dim=0) * d.double().pow(2).sum(dim=1)).sqrt()
        tail = total - torch.cumsum(sigma2.pow(2), 0)  # energy left after each rank
        ok = (tail.clamp_min(0) <= (max_error ** 2) * total).nonzero()
        if len(ok) or q >= min(n, k):
            r = int(ok[0]) + 1 if len(ok) else q
            u, d = u[:, :r].contiguous(), d[:r].contiguous()
            err = float((delta - u @ d).double().pow(2).sum())
            return u, d, math.sqrt(err / total)
        q = min(2 * q, min(n, k))


def _plan_layers(info: SvdqFile, placement: Placement, delta_of: DeltaOf, max_error: float, requantized: list[str]
                 ) -> tuple[dict[str, _Layer], list[dict[str, Any]]]:
    layers: dict[str, _Layer] = {}
    for key, target in info.targets.items():
        if key not in placement:
            continue
        names = placement.names(key)
        if target.role == "bias":
            raise UsageError(f"{names}: a delta on {key}, the bias of a 4-bit layer; the low-rank branch carries "
                             "weights only.", hint="Merge with --requantize, or --skip the adapter's bias keys.")
        for p in target.pieces:
            if p.layer.kind == "w4a4" and "lora_down" not in p.layer.parts:
                raise UsageError(f"{names}: a delta on {key}, whose layer {p.layer.prefix[:-1]} has no low-rank "
                                 "branch to append it to.", hint="Merge with --requantize.")
        for part in placement.pop(key):
            for p in target.pieces:
                entry = layers.setdefault(p.layer.prefix, _Layer(p.layer))
                entry.names.add(names)
            if (isinstance(part, tuple) and part[1].kind == "lora"
                    and all(p.layer.kind == "w4a4" for p in target.pieces)):
                for p in target.pieces:
                    layers[p.layer.prefix].loras.append((target, part))
                continue
            full = delta_of(part, key)
            for p in target.pieces:
                entry = layers[p.layer.prefix]
                rows, cols, at = _rows_cols(target, p.layer.prefix)
                if entry.dense is None:
                    entry.dense = torch.zeros(p.layer.n, p.layer.k)
                entry.dense[at[0]:at[1]] += full[rows[0]:rows[1], cols[0]:cols[1]]
    report = []
    for prefix, entry in layers.items():
        if entry.dense is None:
            continue
        check_tensor(entry.dense, f"the delta on {prefix[:-1]}", None, hint=SUM_HINT)
        if entry.layer.kind == "awq":
            requantized.append(prefix[:-1])
            continue
        u, d, err = factorise(entry.dense, max_error)
        if err > max_error:
            raise UsageError(f"{', '.join(sorted(entry.names))}: the delta on {prefix[:-1]} needs more than rank "
                             f"{u.shape[1]} to stay within --max-error {max_error:g} (error {err:.3g}).",
                             hint="Raise --max-error, or merge with --requantize.")
        entry.dense_factors, entry.error, entry.dense = (u, d), err, None
        report.append({"layer": prefix[:-1], "rank": u.shape[1], "rel_error": err})
    return layers, report


def _new_factors(entry: _Layer, info: SvdqFile, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's branch [stored | LoRAs | dense | zeros] as bf16 U (n, total) and D (total, k)."""
    layer = entry.layer
    n, k = layer.n, layer.k
    ups, downs = [], []
    if "lora_down" in layer.parts:
        ups.append(P.unpack_lowrank(read_stored(layer.parts["lora_up"]), down=False))
        downs.append(P.unpack_lowrank(read_stored(layer.parts["lora_down"]), down=True))
    for target, (adapter, m, strength) in entry.loras:
        up, down = read32(adapter, m, "up"), read32(adapter, m, "down")
        up = up * multiplier(adapter, m, strength)
        rows, cols, at = _rows_cols(target, layer.prefix)
        u = torch.zeros(n, up.shape[1])
        u[at[0]:at[1]] = up[rows[0]:rows[1]]
        ups.append(u.to(torch.bfloat16))
        downs.append(down[:, cols[0]:cols[1]].to(torch.bfloat16))
    if entry.dense_factors is not None:
        ups.append(entry.dense_factors[0].to(torch.bfloat16))
        downs.append(entry.dense_factors[1].to(torch.bfloat16))
    up = pack.pad_rank(torch.cat(ups, dim=1), total, 1) if ups else torch.zeros(n, total, dtype=torch.bfloat16)
    down = pack.pad_rank(torch.cat(downs, dim=0), total, 0) if downs else torch.zeros(total, k, dtype=torch.bfloat16)
    where = f"the merged low-rank branch of {layer.prefix[:-1]}"
    check_tensor(up, where, info.family, hint=SUM_HINT)
    check_tensor(down, where, info.family, hint=SUM_HINT)
    return up, down


def _requantized_awq(layer: SvdqLayer, delta: torch.Tensor, decoder: SvdqDecoder) -> dict[str, torch.Tensor]:
    """An AWQ adaLN layer with `delta` folded in, quantized again (its stored bias is kept)."""
    w = decoder.unpacked(layer).weight(0, layer.n) + delta
    check_tensor(w, f"{layer.prefix[:-1]} plus its delta", None, into=torch.bfloat16, hint=SUM_HINT)
    q = quantize_awq(w)
    s = layer.awq_splits
    rows = layer.parts["wscales"].shape[0]  # deepcompressor pads small layers' groups to 16 rows: kept as stored

    def groups(t: torch.Tensor, fill: float) -> torch.Tensor:
        t = pack.interleave_rows(t, s).t()
        return torch.cat([t, t.new_full((rows - t.shape[0], t.shape[1]), fill)]).contiguous()

    return {"qweight": pack.pack_awq_codes(pack.interleave_rows(q.codes, s)), "wscales": groups(q.scales, 1.0),
            "wzeros": groups(q.zeros, 0.0)}


def merged_name(name: str, total: int) -> str:
    return re.sub(r"_r\d+-", f"_r{total}-", name, count=1)


@dataclass
class _Plan:
    """What a merge appends, requantizes and adds, from the headers and the adapters, before anything is written."""

    info: SvdqFile
    layers: dict[str, _Layer]  # stored layer prefix -> what its branch gains
    plain: dict[str, str]  # stored key of a 16-bit tensor -> its diffusers key, which a delta lands on
    requantized: list[str]  # AWQ layers folded and quantized again
    base_rank: int
    total: int  # the merged branches' common rank
    report: list[dict[str, Any]]  # the factorised dense deltas


def _plan_merge(info: SvdqFile, stored: dict[str, TensorInfo], placement: Placement, delta_of: DeltaOf,
                max_error: float) -> _Plan:
    requantized: list[str] = []
    layers, report = _plan_layers(info, placement, delta_of, max_error, requantized)
    base_rank = max((layer.rank for layer in info.layers.values() if layer.kind == "w4a4"), default=0)
    added = max((e.added_rank for e in layers.values() if e.layer.kind == "w4a4"), default=0)
    plain = {stored_key: diff_key for stored_key in stored
             if (diff_key := info.renamed.get(stored_key, stored_key)) in placement and stored_key not in info.consumed}
    left = [k for k in list(placement.direct) + list(placement.via) if k not in plain.values()]
    if left:
        raise UsageError(f"{placement.names(left[0])}: a delta on {left[0]}, which this SVDQuant file has in no "
                         "form flux-port can add it to.", hint="Merge with --requantize.")
    return _Plan(info, layers, plain, requantized, base_rank, padded(base_rank + added), report)


def _check_copied_branches(info: SvdqFile) -> None:
    """The stored branches are copied, not dequantized: a NaN group scale, a zero smoothing factor or a NaN branch
    would be written on as it is, so they are checked as the decoder does."""
    for layer in info.layers.values():
        if layer.kind == "w4a4":
            unpacked = UnpackedLayer(layer)
            for role, factor in (("lora_up", unpacked.up), ("lora_down", unpacked.down)):
                if factor is not None:
                    check_tensor(factor, repr(layer.parts[role].name), layer.parts[role].file)


def _merged_metadata(metadata: dict[str, str] | None, total: int | None, merged: list[dict[str, Any]]
                     ) -> dict[str, str]:
    """The base's header metadata with the merged rank (None: the rank is in config.json) and this merge appended
    to the record of merged adapters."""
    meta = dict(metadata or {})
    if total is not None:
        qc = json.loads(meta.get("quantization_config", "{}"))
        qc["rank"] = total
        meta["quantization_config"] = json.dumps(qc)
    history = json.loads(meta.get("flux_port_merged", "[]"))
    meta["flux_port_merged"] = json.dumps(history + [{k: v for k, v in a.items() if k != "adapter"}
                                                     | {"adapter": Path(a["adapter"]).name} for a in merged])
    return meta


def _merged_tensors(plan: _Plan, order: list[TensorInfo], placement: Placement
                    ) -> Iterator[torch.Tensor | Segments]:
    """Every stored tensor in file order: branches extended, AWQ layers requantized, 16-bit deltas added, the rest
    copied byte for byte."""
    info, layers, total = plan.info, plan.layers, plan.total
    decoder = SvdqDecoder(info)
    lowrank = {layer.parts[role].name: (prefix, role) for prefix, layer in info.layers.items()
               for role in ("lora_down", "lora_up") if role in layer.parts}
    awq_parts = {layer.parts[role].name: (layer.prefix, role) for layer in info.layers.values()
                 if layer.prefix[:-1] in plan.requantized for role in ("qweight", "wscales", "wzeros")}
    branches: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    awq: dict[str, dict[str, torch.Tensor]] = {}
    for t in order:
        if t.name in lowrank:
            prefix, role = lowrank[t.name]
            if prefix not in branches:
                branches[prefix] = _new_factors(layers.get(prefix) or _Layer(info.layers[prefix]), info, total)
            up, down = branches[prefix]
            yield pack.pack_lowrank(down, True) if role == "lora_down" else pack.pack_lowrank(up, False)
            if role == "lora_up":
                branches.pop(prefix)
        elif t.name in awq_parts:
            prefix, role = awq_parts[t.name]
            if prefix not in awq:
                awq[prefix] = _requantized_awq(info.layers[prefix], layers[prefix].dense, decoder)
            yield awq[prefix][role].to(ST_TO_TORCH[t.dtype]).contiguous()
        elif t.name in plan.plain:
            w = read_stored(t)
            total_w = w.to(torch.float32, copy=True)
            placement.add_into(plan.plain[t.name], total_w)
            check_tensor(total_w, f"{t.name} plus the delta of {placement.names(plan.plain[t.name])}", t.file,
                         into=w.dtype, hint=SUM_HINT)
            yield total_w.to(w.dtype).contiguous()
        else:
            yield Segments(((t.file, t.start, t.nbytes),), t.name)


def merge_into_svdq(source: Source, read: list[tuple[Adapter, float]], placement: Placement, delta_of: DeltaOf,
                    merged: list[dict[str, Any]], out: str | Path, force: bool = False, dry_run: bool = False,
                    max_error: float = MAX_ERROR, on_start: Callable[[int], None] | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> ConvertResult:
    started = time.perf_counter()
    ckpt, detection, plan = plan_source(source, "diffusers")
    info = svdq_info(ckpt)
    assert info is not None
    stored: dict[str, TensorInfo] = ckpt.stored_tensors
    merge = _plan_merge(info, stored, placement, delta_of, max_error)
    src_file = next(iter(stored.values())).file
    lite = info.layout == "diffusers"  # diffusers' Nunchaku folder: its weights file and config.json, rank in it
    name = (table()["lite"]["weights_file"] if lite else merged_name(src_file.name, merge.total)
            if src_file.name.endswith(".safetensors") else "merged.safetensors")
    extra: dict[str, Any] = {"svdq_merge": {
        "base_rank": merge.base_rank, "rank": merge.total,
        "layers_extended": len([e for e in merge.layers.values() if e.layer.kind == "w4a4"]),
        "factorised": merge.report, "requantized": merge.requantized, "plain_merged": sorted(merge.plain.values())},
        "file": name}
    if dry_run:
        return ConvertResult(plan, None, [name], None, time.perf_counter() - started, extra=extra)
    out = Path(out)
    inputs = {"base": source.path, "adapter": [a.path for a, _ in read]}
    check_output(out, force=force, verb="merge", inputs=inputs)
    _check_copied_branches(info)
    meta = _merged_metadata(ckpt.metadata, None if lite else merge.total, merged)
    lowrank = {layer.parts[role].name for layer in info.layers.values() for role in ("lora_down", "lora_up")
               if role in layer.parts}
    order = sorted(stored.values(), key=lambda t: (str(t.file), t.start))
    entries = [Entry(t.name, (t.shape[0], merge.total) if t.name in lowrank else tuple(t.shape), t.dtype)
               for t in order]
    if on_start:
        on_start(sum(e.nbytes for e in entries))
    with atomic_folder(out, force=force, verb="merge", inputs=inputs) as staging:
        # the hasher keeps the file's identity, so validate reads no tensor
        write_shards(staging, name[: -len(".safetensors")], entries, _merged_tensors(merge, order, placement),
                     max_shard_bytes=2**62, metadata=meta, hasher=WeightsHasher())
        if lite:
            raw = json.loads((Path(source.path) / "config.json").read_text())
            raw["quantization_config"]["svdq_w4a4"]["rank"] = merge.total
            (staging / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        manifest = {"tool": "flux-port", "version": __version__, "base": str(source.path.resolve()),
                    "table": detection.table.name, "to": "nunchaku", "files": [name], "merged_adapters": merged,
                    **extra}
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
        source.check_unchanged()
    if on_bytes:
        on_bytes(sum(e.nbytes for e in entries))
    return ConvertResult(plan, out, [name], None, time.perf_counter() - started, extra=extra)


def merge_svdq(source: Source, read: list[tuple[Adapter, float]], placement: Placement, delta_of: DeltaOf,
               merged: list[dict[str, Any]], out: str | Path, to: str | None = None,
               max_shard_size: str | int | None = None, force: bool = False, dry_run: bool = False,
               max_error: float | None = None, requantize: bool = False,
               on_start: Callable[[int], None] | None = None,
               on_bytes: Callable[[int], None] | None = None) -> ConvertResult:
    """`port merge` of an SVDQuant base: appended to the branches, or (`requantize`) folded and quantized again."""
    if to is not None or max_shard_size is not None:
        flag = "--to" if to is not None else "--max-shard-size"
        raise UsageError(f"{flag}: {source.path} is a Nunchaku SVDQuant file; the merge writes one file in its own "
                         "layout.", hint=f"Leave {flag} out, or merge into a bf16 base.")
    if max_error is not None and not (0 < max_error < 1):
        raise UsageError(f"--max-error {max_error:g}: give a relative error between 0 and 1 (e.g. 0.001).")
    if requantize:
        if max_error is not None:
            raise UsageError("--max-error bounds the factorisation of deltas appended to the branch; --requantize "
                             "folds them into the weights instead.", hint="Give one of the two.")
        if dry_run:
            raise UsageError("--requantize with --dry-run: the dry run checks where each key lands; run it without "
                             "--requantize.")
        return requantize_svdq(source, placement, merged, out, force=force, on_start=on_start, on_bytes=on_bytes)
    return merge_into_svdq(source, read, placement, delta_of, merged, out, force=force, dry_run=dry_run,
                           max_error=MAX_ERROR if max_error is None else max_error, on_start=on_start,
                           on_bytes=on_bytes)


def requantize_svdq(source: Source, placement: Placement, merged: list[dict[str, Any]], out: str | Path,
                    force: bool = False, on_start: Callable[[int], None] | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> ConvertResult:
    """The deltas folded into the dequantized weights, quantized again at the base's precision and rank."""
    from porting.engine import svdq_convert

    ckpt, _, _ = plan_source(source, "diffusers")
    info = svdq_info(ckpt)
    assert info is not None

    class Folded(svdq_convert.PlanTensors):
        def get(self, key: str) -> torch.Tensor:
            if key not in self.cache:
                t = super().get(key).to(torch.float32, copy=True)
                if key in placement:
                    placement.add_into(key, t)
                self.cache[key] = t
            return self.cache[key]

    # the rank flux-port's writer was asked for where it recorded one: diffusers' layout stores joined layers at the
    # sum of their pieces' ranks, which requantizing would double again
    rank = int((info.written_by or {}).get("rank_asked") or info.rank)
    result = svdq_convert.convert_svdquant(source, out, f"svdq-{info.precision}", rank=rank, force=force,
                                           on_start=on_start, on_bytes=on_bytes, tensors=Folded,
                                           extra_meta={"merged_adapters": merged}, verb="merge", layout=info.layout)
    result.extra["merged_adapters"] = merged
    return result


__all__ = ["MAX_ERROR", "factorise", "merge_svdq", "merge_into_svdq", "requantize_svdq", "merged_name"]
