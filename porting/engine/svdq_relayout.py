"""`port convert SRC --layout diffusers|nunchaku`: an SVDQuant model moved between Nunchaku's single file and
diffusers' own Nunchaku folder ("Nunchaku Lite"), its packed layers cut and joined without requantizing
(`quant/svdq/relayout.py`).

Where a layer cannot be joined exactly (pieces with different smoothing factors, a linear the source keeps in 16
bits that the other layout quantizes, nvfp4 pieces with different per-tensor scales side by side), that layer alone
is quantized again from the source's dequantized weight, and the result says so by name with its error. Layers the
target layout keeps in 16 bits (diffusers' layout may quantize FLUX.2's modulation linears) are written dequantized
in bf16. The written model is then opened as any input and every tensor not requantized must read back as the
source's, in bf16, bit for bit.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from porting import __version__
from porting.errors import CheckFailed, UsageError
from porting.finite import dumps
from porting.inputs import SourceLike
from porting.outputs import atomic_folder, check_output
from porting.tensors.checkpoint import Checkpoint
from porting.tensors.dtypes import TORCH_TO_ST  # type: ignore[attr-defined]
from porting.tensors.identity import WeightsHasher
from porting.tensors.quant.svdq import layout as L
from porting.tensors.quant.svdq import relayout as X
from porting.tensors.quant.svdq.header import GELU_SHIFT, SvdqFile
from porting.tensors.quant.svdq.quantize import quantize_awq, quantize_w4a4, rel
from porting.tensors.quant.svdq.reader import svdq_info, table
from porting.tensors.writer import Entry, write_shards

from .convert import MANIFEST, ConvertResult, plan_source, weights_source

LAYOUTS = ("diffusers", "nunchaku")
KEEP_LAYERS = 4  # unpacked source layers kept: the pieces of one target are adjacent
ROLES_LITE = {"qweight": "qweight", "wscales": "wscales", "wzeros": "wzeros", "wtscale": "wtscale",
              "wcscales": "wcscales", "smooth": "smooth_factor", "lora_down": "proj_down", "lora_up": "proj_up",
              "bias": "bias"}


class Relayout:
    """One model's layers in the target layout: logical parts by stored layer, biases, what was requantized."""

    def __init__(self, ckpt: Checkpoint, info: SvdqFile) -> None:
        self.ckpt, self.info = ckpt, info
        self._unpacked: OrderedDict[str, X.Logical] = OrderedDict()  # the few recent layers (pieces are adjacent)
        self.requantized: list[dict[str, Any]] = []
        self.branches: dict[str, X.Branch] = {}  # stored key of `lora_down` -> the branch, packed at the end
        # a layer quantized again gets the rank flux-port's writer was asked for, where it recorded one
        self.rank = int((info.written_by or {}).get("rank_asked") or info.rank or 32)

    def unpacked(self, prefix: str) -> X.Logical:
        if prefix not in self._unpacked:
            self._unpacked[prefix] = X.unpack(self.info.layers[prefix])
            while len(self._unpacked) > KEEP_LAYERS:
                self._unpacked.popitem(last=False)
        return self._unpacked[prefix]

    def rank_of_all(self) -> int:
        """The layout's one rank: the largest branch, padded to 16."""
        return L.padded(max((d.shape[0] for d, _ in self.branches.values()), default=0))

    def store(self, out: dict[str, torch.Tensor], prefix: str, names: Mapping[str, str],
              packed: tuple[dict[str, torch.Tensor], X.Branch | None]) -> None:
        body, branch = packed
        out.update({prefix + names[role]: t for role, t in body.items()})
        if branch is not None:
            self.branches[prefix + names["lora_down"]] = branch

    def branches_packed(self, out: dict[str, torch.Tensor], names: Mapping[str, str]) -> int:
        """Every branch padded to the layout's one rank, into `out`; that rank."""
        rank = self.rank_of_all()
        down, up = names["lora_down"], names["lora_up"]
        for key, branch in self.branches.items():
            parts = X.pack_branch(branch, rank)
            out[key] = parts["lora_down"]
            out[key[: -len(down)] + up] = parts["lora_up"]
        return rank

    def requantize(self, name: str, weight: torch.Tensor, pieces: list[int], why: str, awq: bool = False
                   ) -> X.Logical:
        """The layer quantized again from the source's dequantized weight (float32), its error recorded."""
        if awq:
            q = quantize_awq(weight.clone())
            lg = X.Logical("awq", "int4", q.codes, q.scales, q.zeros)
        else:
            parts = quantize_w4a4(weight.clone(), self.info.precision, self.rank, pieces)
            q, lg = parts, X.from_parts(parts, self.info.precision, pieces)
        err = rel(float(q.errors.quantized.sum()), float(q.errors.norm.sum()))
        self.requantized.append({"layer": name, "why": why, "rel_error": err})
        return lg


def _to_lite(job: Relayout) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    info, ckpt = job.info, job.ckpt
    out: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for key, target in info.targets.items():
        if target.role != "weight":
            continue
        module = key[: -len(".weight")]
        pieces = [X.rows(job.unpacked(p.layer.prefix), *p.rows) for p in target.pieces]
        try:
            lg = (X.join_columns if target.join == "columns" else X.join_rows)(pieces, module)
            packed = X.pack(lg, ("wtscale", "wcscales"))
        except X.NotExact as e:
            lg = job.requantize(module, ckpt.read(key), [target.shape[0]], str(e))
            packed = X.pack(lg, ("wtscale", "wcscales"))
        job.store(out, module + ".", ROLES_LITE, packed)
        kinds[module] = lg.kind
        if f"{module}.bias" in info.targets:  # the bias the model adds; an SVDQuant layer's in the vector order
            b = ckpt.read(f"{module}.bias").to(torch.bfloat16)
            out[f"{module}.bias"] = X.P.pack_vector(b) if lg.kind == "w4a4" else b
    rank = job.branches_packed(out, ROLES_LITE)
    for key, t in ckpt.tensors.items():
        if not t.computed:
            out[key] = ckpt.read(key)
    lite = table()["lite"]
    group = 16 if info.precision == "nvfp4" else 64
    qc: dict[str, Any] = {"quant_method": lite["quant_method"], "compute_dtype": lite["compute_dtype"]}
    svdq = [m for m, kind in kinds.items() if kind == "w4a4"]
    awq = [m for m, kind in kinds.items() if kind == "awq"]
    if svdq:
        qc["svdq_w4a4"] = {"precision": info.precision, "group_size": group, "rank": rank, "targets": svdq}
    if awq:
        qc["awq_w4a16"] = {"precision": "int4", "group_size": 64, "targets": awq}
    return out, qc


def _nunchaku_layer(job: Relayout, lp: L.LayerPlan, lite: dict[str, Any]) -> X.Logical:
    """One stored layer of Nunchaku's file from the diffusers layers its slices come from."""
    pieces = []
    for s in lp.weight:
        layer = lite.get(s.key[: -len(".weight")])
        if layer is None or layer.kind != lp.kind:
            raise X.NotExact(f"{s.key} is {'16-bit' if layer is None else layer.kind} in the source, "
                             f"{'AWQ W4A16' if lp.kind == 'awq' else 'SVDQuant W4A4'} in Nunchaku's layout")
        lg = job.unpacked(layer.prefix)
        lg = X.rows(lg, *s.rows) if s.rows else lg
        pieces.append(X.compact(X.columns(lg, *s.cols) if s.cols else lg))  # a cut piece drops the others' rank
    return X.join_rows(pieces, lp.name)


def _weight(ckpt: Checkpoint, lp: L.LayerPlan) -> torch.Tensor:
    parts = []
    for s in lp.weight:
        t = ckpt.read(s.key).float()
        t = t[s.rows[0]:s.rows[1]] if s.rows else t
        parts.append(t[:, s.cols[0]:s.cols[1]] if s.cols else t)
    return torch.cat(parts)


def _bias(ckpt: Checkpoint, lp: L.LayerPlan) -> torch.Tensor:
    return torch.cat([torch.zeros(s) if isinstance(s, int) else
                      ckpt.read(s.key).float()[slice(*s.rows) if s.rows else slice(None)] for s in lp.bias])


def _nunchaku_parts(job: Relayout, lp: L.LayerPlan, lg: X.Logical
                    ) -> tuple[dict[str, torch.Tensor], X.Branch | None]:
    roles = ("wcscales",) if len(lp.pieces) > 1 else ("wtscale",)
    parts, branch = X.pack(lg, roles, lp.awq_splits)
    if lp.kind == "awq":
        s = lp.awq_splits
        b = _bias(job.ckpt, lp).to(torch.bfloat16).view(s, lp.n // s)
        delta = torch.zeros(s, 1, dtype=torch.bfloat16)
        delta[1] = delta[s - 2] = 1  # Nunchaku runs adaLN with scale_shift 0: +1 on the scale slots, in bf16
        parts["bias"] = (b + delta).t().reshape(lp.n).contiguous()
        return parts, None
    parts["smooth_orig"] = parts["smooth"].clone()
    if lp.bias:
        b = _bias(job.ckpt, lp)
        if lp.gelu_shift and job.info.precision == "int4":  # the kernel adds the shift back (decode.py)
            b = b - GELU_SHIFT * X.residual_rowsum(lg)
        parts["bias"] = X.P.pack_vector(b.to(torch.bfloat16))
    return parts, branch


def _to_nunchaku(job: Relayout) -> tuple[L.FileLayout, dict[str, torch.Tensor], int]:
    info, ckpt = job.info, job.ckpt
    shapes = {k: tuple(t.shape) for k, t in ckpt.tensors.items()}
    layout = L.plan_file(info.family, ckpt.config or {}, shapes, str(ckpt.path))
    lite = {prefix[:-1]: layer for prefix, layer in info.layers.items()}
    out: dict[str, torch.Tensor] = {}
    for lp in layout.layers:
        try:
            lg = _nunchaku_layer(job, lp, lite)
            if lg.precision == "nvfp4" and len(lp.pieces) == 1 and not bool((lg.rows == lg.rows[0]).all()):
                raise X.NotExact(f"{lp.name}: its nvfp4 row scales differ and Nunchaku stores one per-tensor scale")
            parts = _nunchaku_parts(job, lp, lg)
        except X.NotExact as e:
            lg = job.requantize(lp.name, _weight(ckpt, lp), list(lp.pieces), str(e), awq=lp.kind == "awq")
            parts = _nunchaku_parts(job, lp, lg)
        job.store(out, lp.name + ".", layout.part_names, parts)
    rank = job.branches_packed(out, layout.part_names)
    for stored, key, _ in layout.plain:
        out[stored] = ckpt.read(key).to(torch.bfloat16)
    return layout, out, rank


def _check(written: Path, ckpt: Checkpoint, requantized: list[dict[str, Any]], family: str) -> int:
    """Every tensor of the source reads back from `written` as the source's in bf16, bit for bit, except the layers
    requantized (and, FLUX.1 int4, a GELU-shifted bias within one bf16 step: that layer's shift is added in float32
    to a bf16 bias). Returns the tensors compared."""
    from porting.inputs import open_source

    again = open_source(written, kind="weights").view
    if set(again.tensors) != set(ckpt.tensors):
        diff = sorted(set(again.tensors) ^ set(ckpt.tensors))
        raise CheckFailed(f"{written}: reads back with other keys than the source ({len(diff)}, e.g. {diff[0]}).",
                          hint="This is a flux-port bug; please report it with the command line.")
    skip = {r["layer"] for r in requantized}
    compared = 0
    for key in ckpt.tensors:
        module = key.rsplit(".", 1)[0]
        if module in skip or any(key.startswith(s + ".") for s in skip) or _in_requantized(key, skip, family):
            continue
        a, b = again.read(key, dtype=torch.bfloat16), ckpt.read(key, dtype=torch.bfloat16)
        if not torch.equal(a, b):
            step = float((a.float() - b.float()).abs().max()) <= float(b.float().abs().max()) * 2**-7
            if not (key.endswith(".bias") and step):
                raise CheckFailed(f"{written}: {key} does not read back as the source's tensor in bf16.",
                                  hint="This is a flux-port bug; please report it with the command line.")
        compared += 1
    return compared


def _in_requantized(key: str, skip: set[str], family: str) -> bool:
    """A diffusers tensor made (in part) of a requantized Nunchaku layer."""
    if not skip:
        return False
    from porting.tensors.quant.svdq.reader import _BLOCK_KEY

    m = _BLOCK_KEY.match(key)
    if not m:
        return False
    base = f"{m.group(1)}.{m.group(2)}."
    local = m.group(3).rsplit(".", 1)[0]
    for entry in table()[family].get(m.group(1), []):
        to = entry["to"] if isinstance(entry["to"], list) else [entry["to"]]
        if local in to and any(base + names[0] in skip for names in entry["from"]):
            return True
    return False


def relayout(src: SourceLike, out: str | Path, layout: str, force: bool = False,
             on_start: Callable[[int], None] | None = None,
             on_bytes: Callable[[int], None] | None = None, source: Path | None = None) -> ConvertResult:
    """`src` moved into `layout`; `source`: the file the manifest names as the source (default `src`: convert
    --quantize --layout diffusers moves a file it wrote in a temporary folder)."""
    started = time.perf_counter()
    ckpt, detection, plan = plan_source(weights_source(src), "diffusers")
    path = Path(ckpt.path)
    info = svdq_info(ckpt)
    if info is None:
        raise UsageError(f"--layout {layout}: {path} is not an SVDQuant model (neither Nunchaku's file nor diffusers' "
                         "Nunchaku folder).", hint=f"To quantize it: port convert {path} --quantize svdq-int4 "
                                                   f"--layout {layout} --out DIR")
    if info.layout == layout:
        raise UsageError(f"--layout {layout}: {path} is already in that layout; nothing to do.",
                         hint="Copy it, or give the other layout.")
    out = Path(out)
    check_output(out, force=force, verb="convert", inputs={"source": path})
    job = Relayout(ckpt, info)
    # what flux-port's writer recorded (rank asked, smoothing) is kept, with the move added
    made = {**(info.written_by or {}), "tool": "flux-port", "version": __version__, "relayout_from": info.layout}
    if layout == "diffusers":
        tensors, qc = _to_lite(job)
        config = {**(ckpt.config or {}), "_class_name": detection.table.diffusers_class, "quantization_config": qc}
        rank, name = qc.get("svdq_w4a4", {}).get("rank", 0), table()["lite"]["weights_file"]
        entries = [Entry(k, tuple(t.shape), TORCH_TO_ST[t.dtype]) for k, t in tensors.items()]
        metadata = {"format": "pt", "flux_port": json.dumps(made), **{
            k: v for k, v in (ckpt.metadata or {}).items() if k in ("flux_port_merged", "merged_adapters")}}
    else:
        file_layout, tensors, rank = _to_nunchaku(job)
        entries = [Entry(k, s, d) for k, s, d in file_layout.entries(info.precision, rank)]
        name = L.file_name(info.precision, rank, path)
        config = {**(ckpt.config or {}), "_class_name": detection.table.diffusers_class}
        metadata = L.metadata(info.family, config, info.precision, rank, {"flux_port": made})
    total = sum(e.nbytes for e in entries)
    if on_start:
        on_start(total)

    def items() -> Iterator[torch.Tensor]:
        for e in entries:
            yield tensors[e.key].contiguous()

    with atomic_folder(out, force=force, verb="convert", inputs={"source": path}) as staging:
        write_shards(staging, name[: -len(".safetensors")], entries, items(), max_shard_bytes=2**62,
                     metadata=metadata, hasher=WeightsHasher())
        if layout == "diffusers":
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        compared = _check(staging if layout == "diffusers" else staging / name, ckpt, job.requantized, info.family)
        extra = {"layout": {"from": info.layout, "to": layout, "rank": rank, "tensors_identical": compared,
                            "requantized": job.requantized}}
        manifest = {"tool": "flux-port", "version": __version__, "source": str((source or path).resolve()),
                    "table": info.family, "to": layout, "files": [name], **extra}
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
    if on_bytes:
        on_bytes(total)
    return ConvertResult(plan, out, [name], None, time.perf_counter() - started, extra=extra)


__all__ = ["LAYOUTS", "relayout"]
