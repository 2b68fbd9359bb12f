"""`port convert --to original --quantize ...`: original-naming weights written as one quantized file, then reread.

The reread opens the written file through the same readers any input goes through (so the file is proved to be
detected as the layout it claims and as the same model), dequantizes every tensor and compares it with what was
meant (the source weights in float32): the dequantized error is part of the result and the manifest.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from porting import __version__
from porting.errors import CheckFailed, PortError
from porting.families.mapping import MappingTable
from porting.finite import check_tensor, dumps, peak
from porting.inputs import Source, SourceLike, open_source
from porting.outputs import atomic_folder, check_output
from porting.tensors.checkpoint import Checkpoint

from .convert import (
    MANIFEST,
    ConvertResult,
    plan_source,
    resolve_dtype,
    stranded_sidecars,
    strict_error,
    weights_source,
)
from .plan import Plan

TARGETS: dict[str, tuple[str, str]] = {  # option -> (layout, file name)
    "fp8-scaled": ("ComfyUI scaled fp8", "model-fp8-scaled.safetensors"),
    "gguf-q8_0": ("GGUF Q8_0", "model-Q8_0.gguf"),
    "gguf-q4_0": ("GGUF Q4_0", "model-Q4_0.gguf"),
}


def _source_tensors(ckpt: Checkpoint, plan: Plan) -> Iterator[torch.Tensor]:
    """Target tensors in plan order, in memory one step at a time (quantizers need the values); a layer with a NaN
    or Inf is refused by name: its quantization scale would be NaN and every value of it lost."""
    for ps in plan.steps:
        for key, t in zip(ps.step.targets, ps.step.op.apply([ckpt.read(k) for k in ps.stored_sources])):
            check_tensor(t, f"layer {key} (from {', '.join(ps.stored_sources)}) cannot be quantized: it", ckpt.path,
                         hint="--quantize needs finite weights; the source is damaged or from a diverged run.")
            yield t


def _write(target: str, path: Path, specs: list[tuple[str, tuple[int, ...]]], tensors: Iterator[torch.Tensor],
           plain: str) -> dict[str, str]:
    if target == "fp8-scaled":
        from porting.tensors.export import scaled_fp8

        return scaled_fp8.write(path, specs, tensors, plain)
    from porting.tensors.export import gguf_file

    return gguf_file.write(path, specs, tensors, target.split("-", 1)[1].upper(), plain)


def reread_error(path: Path, ckpt: Checkpoint, plan: Plan, kinds: Mapping[str, str]) -> dict[str, Any]:
    """Open what was written, check it is the same model, and measure dequantized vs meant (relative L2)."""
    detection = open_source(path, kind="weights").detection  # this open is the check: the file as any input is read
    written = detection.ckpt
    source_config = plan.detection.config
    differ = [f for f in plan.detection.family.structural_fields if source_config.get(f) != detection.config.get(f)]
    prefix = detection.prefix
    keys = {k[len(prefix):] for k in written.tensors if k.startswith(prefix)}
    meant = [key for key, _, _ in plan.outputs()]
    if differ or detection.naming != "original" or keys != set(meant):
        raise CheckFailed(f"{path}: the written file does not read back as the model that was meant "
                          f"(fields {differ}, naming {detection.naming}, {len(keys ^ set(meant))} keys differ).",
                          hint="This is a flux-port bug; please report it with the command line.")
    per_kind: dict[str, dict[str, Any]] = {}
    worst: tuple[float, str] = (0.0, "")
    for key, want in zip(meant, _source_tensors(ckpt, plan)):
        got = written.read(prefix + key).float()
        want = want.float()
        if tuple(got.shape) != tuple(want.shape):
            raise CheckFailed(f"{path}: {key} reads back as {list(got.shape)}, meant {list(want.shape)}.")
        err = _rel_l2(got, want)
        row = per_kind.setdefault(kinds[key], {"tensors": 0, "max_rel_l2": 0.0, "sum": 0.0})
        row["tensors"] += 1
        row["sum"] += err
        row["max_rel_l2"] = max(row["max_rel_l2"], err)
        worst = max(worst, (err, key))
    for row in per_kind.values():
        row["mean_rel_l2"] = row.pop("sum") / row["tensors"]
    return {"layout": written.quantization.label if written.quantization else written.container,
            "by_kind": per_kind, "worst_rel_l2": worst[0], "worst_key": worst[1]}


def write_manifest(staging: Path, manifest: dict[str, Any], ckpt: Checkpoint, source: Source) -> None:
    """The manifest of a quantized output, once the file is written; the source must not have changed meanwhile."""
    if ckpt.quantization:
        manifest["dequantized_from"] = ckpt.quantization.label
    (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
    source.check_unchanged()


def _sha256(path: Path) -> str:
    """The written file's sha256, for the manifest (a quantized file has no plain weights to hash as convert does);
    recorded, so that publish and push do not read the file again."""
    from porting.known_digests import file_sha256

    return file_sha256(path)


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (absolute when want is 0); float32 norms of large values overflow, so those are taken
    again on values divided by the largest magnitude (finite inputs give a finite error)."""
    diff = got - want
    norm, dist = want.norm().item(), diff.norm().item()
    if not (math.isfinite(norm) and math.isfinite(dist)):
        s = max(peak(want), peak(diff), 1.0)
        norm, dist = (want / s).norm().item() * s, (diff / s).norm().item() * s
    return dist / norm if norm > 0 else dist


def convert_quantized(src: SourceLike, out: str | Path, quantize: str, dtype: str = "keep",
                      config: str | Path | None = None, strict: bool = True, force: bool = False,
                      on_start: Callable[[int], None] | None = None, on_bytes: Callable[[int], None] | None = None,
                      tables: Mapping[str, MappingTable] | None = None) -> ConvertResult:
    if quantize not in TARGETS:
        raise PortError(f"--quantize {quantize!r}: use one of {', '.join(TARGETS)}.")
    started = time.perf_counter()
    source = weights_source(src, config, tables)
    ckpt, detection, plan = plan_source(source, "original", dtype)
    if strict and not plan.ok:
        raise strict_error(plan, src)
    stranded = stranded_sidecars(plan)
    if stranded is not None:
        raise stranded
    outputs = list(plan.outputs())
    stored = {d for _, _, d in outputs}
    plain = resolve_dtype(ckpt, dtype) or (stored.pop() if len(stored) == 1 else "F32")
    specs = [(k, s) for k, s, _ in outputs]
    layout, name = TARGETS[quantize]
    out = Path(out)
    read_paths = {"source": source.path, "--config": config}
    check_output(out, force=force, verb="convert", inputs=read_paths)  # before the long work
    if on_start:
        on_start(plan.output_bytes)
    with atomic_folder(out, force=force, verb="convert", inputs=read_paths) as staging:
        kinds = _write(quantize, staging / name, specs, _source_tensors(ckpt, plan), plain)
        reread = reread_error(staging / name, ckpt, plan, kinds)
        file_sha256 = _sha256(staging / name)
        counts: dict[str, int] = {}
        for kind in kinds.values():
            counts[kind] = counts.get(kind, 0) + 1
        extra = {"quantized_to": layout, "file": name, "file_sha256": file_sha256, "stored_kinds": counts,
                 "reread": reread}
        manifest = {
            "tool": "flux-port", "version": __version__, "source": str(source.path.resolve()),
            "source_naming": detection.naming_label, "table": detection.table.name, "to": "original",
            "variant": detection.variant, "dtype": {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(plain, plain),
            "tensors": len(specs), "files": [name],
            "config": detection.config, **extra,
        }
        write_manifest(staging, manifest, ckpt, source)
    if on_bytes:
        on_bytes(plan.output_bytes)
    quant = ckpt.quantization.to_dict() if ckpt.quantization else None
    return ConvertResult(plan, out, [name], None, time.perf_counter() - started, quantization=quant, extra=extra)
