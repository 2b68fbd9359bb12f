"""`port convert`: plan, check, then stream tensors from the source through the table's operations to disk."""

from __future__ import annotations

import importlib.metadata
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

if TYPE_CHECKING:
    import torch

from porting import __version__
from porting.errors import PlanError
from porting.families.mapping import MappingTable, Naming
from porting.finite import check_tensor, dumps
from porting.inputs import Source, SourceLike, as_source, shown
from porting.inputs.detect import Detection, load_base_config
from porting.known_digests import tensor_digests
from porting.outputs import InputPaths, atomic_folder, check_output
from porting.tensors.checkpoint import Checkpoint
from porting.tensors.dtypes import itemsize, torch_dtype
from porting.tensors.sidecars import is_sidecar
from porting.tensors.writer import (
    Chunks,
    Entry,
    Segments,
    WeightsHasher,
    parse_size,
    plan_shards,
    shard_names,
    write_shards,
)
from porting.text import one_line

from .plan import Plan, build_plan, torch_dtype_tag

MANIFEST = "flux-port.json"  # written next to the weights; validate and publish read it
BLOCK_ELEMENTS = 4 * 2**20  # computed (dequantized) tensors are produced this many values at a time; larger
# blocks are slower, not faster: each is a fresh allocation the kernel must map and zero (16 Mi: half the speed)


@dataclass
class ConvertResult:
    plan: Plan
    out: Path | None
    files: list[str] = field(default_factory=list)
    weights_sha256: str | None = None
    seconds: float = 0.0
    quantization: dict[str, Any] | None = None  # the source's quantized layout, when it had one
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {"out": str(self.out) if self.out else None, "files": self.files,
             "weights_sha256": self.weights_sha256, "seconds": round(self.seconds, 3), **self.plan.summary()}
        if self.quantization:
            d["quantization"] = self.quantization
            d["dequantized_from"] = self.quantization["label"]
        return {**d, **self.extra}


def prepare(src: SourceLike, to: Naming = "diffusers", dtype: str = "keep",
            config: str | Path | None = None,
            tables: Mapping[str, MappingTable] | None = None) -> tuple[Checkpoint, Detection, Plan]:
    """Open headers (a path; an opened `Source` is used as it is), detect, and plan; nothing is read beyond headers.

    `tables` replaces the built-in mapping tables (by name), e.g. a table loaded with `load_table_file`. The
    checkpoint returned is the detected view (keys as the table spells them) that the plan addresses.
    """
    return plan_source(weights_source(src, config, tables), to, dtype)


def weights_source(src: SourceLike, config: str | Path | None = None,
                   tables: Mapping[str, MappingTable] | None = None) -> Source:
    """`src` opened (headers) as transformer weights, to be detected against `config` (a base folder or config.json)
    and `tables`; the file is opened before the config is read, as its errors come first."""
    source = as_source(src, kind="weights", tables=tables)
    return as_source(source, base_config=load_base_config(config)) if config else source


def plan_source(source: Source, to: Naming = "diffusers", dtype: str = "keep") -> tuple[Checkpoint, Detection, Plan]:
    """Detect (once per source) and plan `source` for `to` naming and `dtype`."""
    detection = source.detection
    ckpt = detection.ckpt
    plan = build_plan(ckpt, detection, to, resolve_dtype(ckpt, dtype))
    return ckpt, detection, plan


def resolve_dtype(ckpt: Checkpoint, dtype: str) -> str | None:
    """The output dtype tag: `keep` keeps stored dtypes, except that dequantized weights default to bf16."""
    tag = torch_dtype_tag(dtype)
    if tag is None and ckpt.quantization is not None:
        return "BF16"
    return tag


def stranded_sidecars(plan: Plan) -> PlanError | None:
    """Quantization sidecars no reader consumed: dropping them would write raw quantized values as weights."""
    keys = [k for k, _ in plan.unexpected if is_sidecar(k)]
    if not keys:
        return None
    return PlanError(
        f"{len(keys)} quantization tensor(s) are not part of any layout flux-port reads (e.g. {keys[0]!r}); "
        "dropping them would leave quantized values behind as if they were the weights, so convert refuses, "
        "with or without --strict. Nothing was written.",
        hint="Check `port inspect` on the file: a scale without its layout marker (scaled_fp8, comfy_quant) or a "
             "weight_scale next to a plain weight is not a layout flux-port can interpret.",
        details="\n".join(one_line(f"  {k}") for k in keys[:40]), report=plan.summary())


def strict_error(plan: Plan, src: SourceLike) -> PlanError:
    rows = plan.problems()
    lines = []
    for r in rows[:40]:
        extra = ""
        if r.get("source"):
            extra = f" (from {r['source']} in the file)"
        if r["kind"] == "shape mismatch":
            extra += f" produced {r['produced']}, model expects {r['expected']}"
        elif r.get("message"):
            extra += f" {r['message']}"
        elif r.get("closest"):
            extra += f" (closest known: {r['closest']})"
        lines.append(one_line(f"  {r['kind']:<20} {r['key']}{extra}"))
    if len(rows) > 40:
        lines.append(f"  ... and {len(rows) - 40} more (use --json for all)")
    return PlanError(
        f"{shown(src)}: strict plan failed: {len(rows)} problem(s) converting {plan.detection.table.name} "
        f"{plan.source_naming} -> {plan.target_naming}; nothing was written.",
        hint="A fine-tune must have exactly the base architecture's tensors. Unexpected quantization keys "
             "(scale_weight, comfy_quant) need a dequantized file; missing blocks mean a truncated or pruned file.",
        details="\n".join(lines), report=plan.summary())


def iter_tensors(ckpt: Checkpoint, plan: Plan) -> Iterator[torch.Tensor | Segments]:
    """Target tensors in plan order, one step at a time (peak memory: one rule group).

    A step that only moves rows along dim 0 and keeps the dtype yields `Segments` (byte ranges of the source files)
    for the writer to copy file to file. A row-moving step with computed (dequantized) sources yields `Chunks`: the
    same rows, computed a block at a time and cast to the output dtype. Any other step reads its sources and applies
    the operation in memory.
    """
    for ps in plan.steps:
        infos = [ckpt.tensors[k] for k in ps.stored_sources]
        shapes = [i.shape for i in infos]
        computed = any(i.computed for i in infos)
        ranges = None
        if not computed and all(i.dtype == ps.out_dtype for i in infos):
            ranges = ps.step.op.byte_ranges(shapes, itemsize(ps.out_dtype))
        if ranges is not None:
            for parts in ranges:
                yield Segments(tuple((infos[i].file, infos[i].start + off, n) for i, off, n in parts),
                               ", ".join(ps.stored_sources))
            continue
        target = torch_dtype(ps.out_dtype)
        rows = ps.step.op.byte_ranges(shapes, 1) if computed and all(len(s) >= 1 for s in shapes) else None
        if rows is not None:  # element ranges of whole rows: computed block by block
            for parts in rows:
                yield Chunks(_row_blocks(ckpt, ps.stored_sources, shapes, parts, target), ", ".join(ps.stored_sources))
            continue
        inputs = [ckpt.read(k) for k in ps.stored_sources]
        outputs = ps.step.op.apply(inputs)
        for key, t in zip(ps.step.targets, outputs):
            check_cast(key, ps.stored_sources, t, target)
            yield t.to(target).contiguous()
        del inputs, outputs


def check_cast(key: str, sources: tuple[str, ...], tensor: torch.Tensor, target: torch.dtype) -> None:
    """Refuse a computed tensor with NaN / Inf values, or one whose cast turns finite values into infinities
    (fp32/bf16 values beyond fp16's 65504, say)."""
    if not tensor.is_floating_point():
        return
    check_tensor(tensor, key, ", ".join(sources),
                 into=target if target.is_floating_point else None,
                 hint="Keep the source dtype (--dtype keep) or use bf16, which has float32's range." if
                 target.is_floating_point else None)


def _row_blocks(ckpt: Checkpoint, keys: tuple[str, ...], shapes: list[tuple[int, ...]],
                parts: list[tuple[int, int, int]], target: torch.dtype) -> Iterator[torch.Tensor]:
    """The rows `parts` names ((input, element offset, element count) of whole rows), a block at a time."""
    for i, offset, count in parts:
        inner = math.prod(shapes[i][1:])
        first, last = offset // inner, (offset + count) // inner
        step = max(1, BLOCK_ELEMENTS // max(inner, 1))
        for a in range(first, last, step):
            yield ckpt.read(keys[i], (a, min(a + step, last)), dtype=target).contiguous()


OUTPUT_STEM: dict[str, str] = {"diffusers": "diffusion_pytorch_model", "original": "model"}
DEFAULT_SHARD_SIZE: dict[str, str | None] = {"diffusers": "5GB", "original": None}  # None: one file
ONE_FILE_RUNTIMES = "ComfyUI, Forge and BFL's reference code"


def shard_limit(to: Naming, max_shard_size: str | int | None,
                on_notice: Callable[[str], None] | None = None) -> int:
    """The largest shard in bytes for output in `to` naming (see `convert`)."""
    size = DEFAULT_SHARD_SIZE[to] if max_shard_size is None else max_shard_size
    if size is None:
        return sys.maxsize
    if to == "original" and max_shard_size is not None and on_notice:
        on_notice(f"--max-shard-size {max_shard_size}: original-naming shards; {ONE_FILE_RUNTIMES} load one "
                  ".safetensors per diffusion model and cannot load shards (leave --max-shard-size out for one file)")
    return parse_size(size)


def planned_files(stem: str, entries: list[Entry], limit: int) -> list[dict[str, Any]]:
    """The files a run would write: name, tensor count and bytes, from the same sharding the writer uses."""
    shards = plan_shards(entries, limit)
    return [{"name": name, "tensors": len(shard), "bytes": sum(e.nbytes for e in shard)}
            for name, shard in zip(shard_names(stem, len(shards)), shards)]


def convert(src: SourceLike, out: str | Path | None, to: Naming = "diffusers", dtype: str = "keep",
            config: str | Path | None = None, max_shard_size: str | int | None = None, strict: bool = True,
            dry_run: bool = False, force: bool = False,
            on_start: Callable[[int], None] | None = None,
            on_bytes: Callable[[int], None] | None = None,
            tables: Mapping[str, MappingTable] | None = None,
            tensors: Callable[[Checkpoint, Plan], Iterator[torch.Tensor | Segments]] | None = None,
            manifest_extra: Mapping[str, Any] | None = None,
            on_notice: Callable[[str], None] | None = None,
            inputs: InputPaths | None = None, identity: bool = True) -> ConvertResult:
    """Convert a checkpoint; with `strict`, refuse any plan that does not account for every key and shape.

    `max_shard_size` None: diffusers output in 5 GB shards (what `save_pretrained` writes), original output as one
    file whatever its size (ComfyUI, Forge and BFL's code load one `.safetensors` per diffusion model and cannot
    load shards; given shard 1 ComfyUI silently detects a smaller model). An explicit size shards either naming,
    with a warning through `on_notice` for original naming.

    `src` is a path, or its opened `Source` (`port merge` hands over the base it placed its adapters on: one
    `Checkpoint` for placement and writing); the files are checked unchanged since their headers were read before
    the output is put in place.

    `tensors` replaces `iter_tensors` as the source of the target tensors (e.g. `port merge` adds adapter deltas on
    the way); `manifest_extra` adds fields to the manifest; `inputs` names further paths the caller reads (merge's
    adapters), which `out` must not be, contain or lie inside, like the source and `config`.

    `identity` False (what `port convert` does): the weights identity is taken only where every tensor's sha256 is
    at hand (port fetch recorded it, or the tensor is computed here); otherwise `weights_sha256` is None and the
    identity is left to the first verb that certifies the weights (validate, publish), which records it for the
    others, so a warm convert costs what its copy costs.
    """
    started = time.perf_counter()
    source = weights_source(src, config, tables)
    ckpt, detection, plan = plan_source(source, to, dtype)
    quant = ckpt.quantization.to_dict() if ckpt.quantization else None
    if strict and not plan.ok:
        raise strict_error(plan, src)
    stranded = stranded_sidecars(plan)  # refused with --no-strict too
    if stranded is not None:
        raise stranded
    limit = shard_limit(to, max_shard_size, on_notice)
    entries = [Entry(k, s, d) for k, s, d in plan.outputs()]
    stem = OUTPUT_STEM[to]
    if dry_run or out is None:
        return ConvertResult(plan, None, seconds=time.perf_counter() - started, quantization=quant,
                             extra={"planned_files": planned_files(stem, entries, limit)})
    out = Path(out)
    read_paths = {"source": source.path, "--config": config, **(inputs or {})}
    check_output(out, force=force, verb="convert", inputs=read_paths)
    hasher = WeightsHasher()
    if on_start:
        on_start(plan.output_bytes)
    with atomic_folder(out, force=force, verb="convert", inputs=read_paths, on_notice=on_notice) as staging:
        files = write_shards(staging, stem, entries, (tensors or iter_tensors)(ckpt, plan), limit,
                             metadata={"format": "pt"}, on_bytes=on_bytes, hasher=hasher,
                             known=tensor_digests(source.stamps), defer=not identity)
        if to == "diffusers":
            cfg = {**detection.config, "_class_name": detection.table.diffusers_class}
            cfg["_diffusers_version"] = importlib.metadata.version("diffusers")  # the version, without the import
            (staging / "config.json").write_text(dumps(cfg, indent=2, sort_keys=True) + "\n")
        weights = hasher.hexdigest() if hasher.complete else None  # None: left to validate / publish
        manifest = {
            "tool": "flux-port", "version": __version__, "format_version": 1, "source": str(source.path.resolve()),
            "source_naming": detection.naming_label, "table": detection.table.name, "to": to,
            "variant": detection.variant, "dtype": dtype, "tensors": len(entries), "files": files,
            "weights_sha256": weights, "config": detection.config,
            **(manifest_extra or {}),
        }
        if quant:
            manifest["dtype"] = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(str(resolve_dtype(ckpt, dtype)),
                                                                                   dtype)
            manifest["dequantized_from"] = quant["label"]
            manifest["quantization"] = quant
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
        source.check_unchanged()
    return ConvertResult(plan, out, files, weights, time.perf_counter() - started, quantization=quant)
