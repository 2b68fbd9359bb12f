"""`port convert`: plan, check, then stream tensors from the source through the table's operations to disk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from porting import __version__
from porting.errors import PlanError
from porting.tensors.checkpoint import ST_TO_TORCH, Checkpoint, open_checkpoint
from porting.tensors.writer import Entry, Segments, WeightsHasher, atomic_folder, parse_size, write_shards

from .detect import Detection, detect, load_base_config
from .mapping import MappingTable, Naming
from .plan import Plan, build_plan, torch_dtype_tag

MANIFEST = "flux-port.json"  # written next to the weights; validate and publish read it


@dataclass
class ConvertResult:
    plan: Plan
    out: Path | None
    files: list[str] = field(default_factory=list)
    weights_sha256: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"out": str(self.out) if self.out else None, "files": self.files,
                "weights_sha256": self.weights_sha256, "seconds": round(self.seconds, 3), **self.plan.summary()}


def prepare(src: str | Path, to: Naming = "diffusers", dtype: str = "keep",
            config: str | Path | None = None,
            tables: Mapping[str, MappingTable] | None = None) -> tuple[Checkpoint, Detection, Plan]:
    """Open headers, detect, and plan; nothing is read beyond headers.

    `tables` replaces the built-in mapping tables (by name), e.g. a table loaded with `load_table_file`.
    """
    ckpt = open_checkpoint(src)
    base = load_base_config(config) if config else None
    detection = detect(ckpt, base, tables)
    plan = build_plan(ckpt, detection, to, torch_dtype_tag(dtype))
    return ckpt, detection, plan


def strict_error(plan: Plan, src: str | Path) -> PlanError:
    rows = plan.problems()
    lines = []
    for r in rows[:40]:
        extra = ""
        if r["kind"] == "shape mismatch":
            extra = f" produced {r['produced']}, model expects {r['expected']}"
        elif r.get("message"):
            extra = f" {r['message']}"
        elif r.get("closest"):
            extra = f" (closest known: {r['closest']})"
        lines.append(f"  {r['kind']:<20} {r['key']}{extra}")
    if len(rows) > 40:
        lines.append(f"  ... and {len(rows) - 40} more (use --json for all)")
    return PlanError(
        f"{src}: strict plan failed: {len(rows)} problem(s) converting {plan.detection.table.name} "
        f"{plan.source_naming} -> {plan.target_naming}; nothing was written.",
        hint="A fine-tune must have exactly the base architecture's tensors. Unexpected quantization keys "
             "(scale_weight, comfy_quant) need a dequantized file; missing blocks mean a truncated or pruned file.",
        details="\n".join(lines), report=plan.summary())


def iter_tensors(ckpt: Checkpoint, plan: Plan) -> Iterator[torch.Tensor | Segments]:
    """Target tensors in plan order, one step at a time (peak memory: one rule group).

    A step that only moves rows along dim 0 and keeps the dtype yields `Segments` (byte ranges of the source files)
    for the writer to copy file to file; any other step reads its sources and applies the operation in memory.
    """
    for ps in plan.steps:
        infos = [ckpt.tensors[k] for k in ps.stored_sources]
        ranges = None
        if all(i.dtype == ps.out_dtype for i in infos):
            ranges = ps.step.op.byte_ranges([i.shape for i in infos], ST_TO_TORCH[ps.out_dtype].itemsize)
        if ranges is not None:
            for parts in ranges:
                yield Segments(tuple((infos[i].file, infos[i].start + off, n) for i, off, n in parts),
                               ", ".join(ps.stored_sources))
            continue
        inputs = [ckpt.read(k) for k in ps.stored_sources]
        outputs = ps.step.op.apply(inputs)
        target = ST_TO_TORCH[ps.out_dtype]
        for t in outputs:
            yield t.to(target).contiguous()
        del inputs, outputs


def convert(src: str | Path, out: str | Path | None, to: Naming = "diffusers", dtype: str = "keep",
            config: str | Path | None = None, max_shard_size: str | int = "5GB", strict: bool = True,
            dry_run: bool = False, force: bool = False,
            on_start: Callable[[int], None] | None = None,
            on_bytes: Callable[[int], None] | None = None,
            tables: Mapping[str, MappingTable] | None = None,
            tensors: Callable[[Checkpoint, Plan], Iterator[torch.Tensor | Segments]] | None = None,
            manifest_extra: Mapping[str, Any] | None = None) -> ConvertResult:
    """Convert a checkpoint; with `strict`, refuse any plan that does not account for every key and shape.

    `tensors` replaces `iter_tensors` as the source of the target tensors (e.g. `port merge` adds adapter deltas on
    the way); `manifest_extra` adds fields to the manifest.
    """
    started = time.perf_counter()
    ckpt, detection, plan = prepare(src, to, dtype, config, tables)
    if strict and not plan.ok:
        raise strict_error(plan, src)
    if dry_run or out is None:
        return ConvertResult(plan, None, seconds=time.perf_counter() - started)
    out = Path(out)
    limit = parse_size(max_shard_size)
    entries = [Entry(k, s, d) for k, s, d in plan.outputs()]
    stem = "diffusion_pytorch_model" if to == "diffusers" else "model"
    hasher = WeightsHasher()
    if on_start:
        on_start(plan.output_bytes)
    with atomic_folder(out, force=force) as staging:
        files = write_shards(staging, stem, entries, (tensors or iter_tensors)(ckpt, plan), limit,
                             metadata={"format": "pt"}, on_bytes=on_bytes, hasher=hasher)
        if to == "diffusers":
            cfg = {**detection.config, "_class_name": detection.table.diffusers_class}
            import diffusers
            cfg["_diffusers_version"] = diffusers.__version__
            (staging / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        manifest = {
            "tool": "flux-port", "version": __version__, "source": str(Path(src).resolve()),
            "source_naming": detection.naming_label, "table": detection.table.name, "to": to,
            "variant": detection.variant, "dtype": dtype, "tensors": len(entries), "files": files,
            "weights_sha256": hasher.hexdigest(), "config": detection.config, **(manifest_extra or {}),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return ConvertResult(plan, out, files, hasher.hexdigest(), time.perf_counter() - started)
