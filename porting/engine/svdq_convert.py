"""`port convert SRC --quantize svdq-int4|svdq-nvfp4 [--rank R] --out DIR`: one Nunchaku SVDQuant file, data-free.

Any weights flux-port reads (BFL or diffusers naming, bf16, fp8, GGUF, ...) are planned to diffusers names, then
each quantized layer is made from its diffusers tensors, one layer in memory at a time
(`porting/tensors/export/svdquant.py`). The written file is then opened through the same reader as any input
(`porting/tensors/quant/svdq/reader.py`): it must be detected as the same model, its 16-bit tensors must be the
source's in bf16, and every weight it yields must carry the error the writer computed for it (the file holds
exactly what the writer meant).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch

from porting import __version__
from porting.errors import CheckFailed, UsageError
from porting.families.mapping import MappingTable
from porting.inputs import SourceLike, open_source
from porting.outputs import atomic_folder, check_output
from porting.resources import MEMORY_OVERHEAD, require_memory
from porting.tensors.checkpoint import Checkpoint
from porting.tensors.export import svdquant as writer
from porting.tensors.quant.svdq import layout as L
from porting.tensors.quant.svdq.quantize import ALPHA, BAND

from .convert import ConvertResult, plan_source, stranded_sidecars, strict_error, weights_source
from .plan import Plan
from .quantize import _sha256, write_manifest

PRECISIONS = {"svdq-int4": "int4", "svdq-nvfp4": "nvfp4"}
SMOOTHING = (f"data-free: s_j = max|W[:, j]|^-{1 - ALPHA:g} (SmoothQuant, alpha {ALPHA:g}, activation ranges "
             "assumed equal), geometric mean 1")


class PlanTensors:
    """Diffusers-named tensors of a plan, each rule group read and applied once, kept until released."""

    def __init__(self, ckpt: Checkpoint, plan: Plan) -> None:
        self.ckpt = ckpt
        self.step_of = {t: ps for ps in plan.steps for t in ps.step.targets}
        self.cache: dict[str, torch.Tensor] = {}

    def get(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            ps = self.step_of[key]
            outputs = ps.step.op.apply([self.ckpt.read(k) for k in ps.stored_sources])
            for target, t in zip(ps.step.targets, outputs):
                self.cache.setdefault(target, t)
        return self.cache[key]

    def release(self, key: str) -> None:
        self.cache.pop(key, None)


def check_rank(rank: int) -> None:
    if rank < 1 or rank > 1024:
        raise UsageError(f"--rank {rank}: the low-rank branch needs a rank from 1 to 1024 (Nunchaku's files use 32).",
                         hint="Use --rank 32, or 16 / 64 for a smaller or larger branch.")


def layer_memory(layout: L.FileLayout, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, str]:
    """Bytes one layer's quantization holds at its peak: its float32 copy twice (scratch and the source rule
    group's tensors), its codes and the low-rank factors."""
    biggest = max(layout.layers, key=lambda layer: layer.n * layer.k)
    sources = sum(4 * math.prod(shapes[key]) for key in biggest.sources)
    need = MEMORY_OVERHEAD + 8 * biggest.n * biggest.k + sources
    return need, f"the interpreter and the largest layer {biggest.name} [{biggest.n}, {biggest.k}] in float32"


def reread(path: Path, family: str, layout: L.FileLayout, quality: writer.Quality, tensors: PlanTensors | None,
           biases: Mapping[str, float]) -> dict[str, Any]:
    """Open the written file as any input and check it holds what the writer meant (module docstring); without
    `tensors` (the source can not be read a second time) only that it is the model meant."""
    detection = open_source(path, kind="weights").detection
    written = detection.ckpt
    meant = {key for _, key, _ in layout.plain} | set(quality.targets) | set(biases)
    got_keys = set(written.tensors)
    if detection.table.name != family or written.quantization is None or got_keys != meant:
        raise CheckFailed(f"{path}: the written file does not read back as the model that was meant (family "
                          f"{detection.table.name}, {len(got_keys ^ meant)} keys differ).",
                          hint="This is a flux-port bug; please report it with the command line.")
    worst = (0.0, "")
    # what the file's layers read back as: diffusers tensors (weights and biases) by kind of layer; not the stored
    # layer count (Nunchaku fuses q/k/v into one layer and splits some projections in two)
    read_as = {"layout": written.quantization.label, "format": written.quantization.to_dict()["format"],
               "tensors": dict(written.quantization.to_dict()["layers"])}
    if tensors is None:
        return {**read_as, "worst_rel_l2": math.sqrt(max(
            (e / n if n else 0.0) for e, _, n in quality.targets.values())), "worst_key": "", "values": "not reread"}
    for _, key, _ in layout.plain:
        if not torch.equal(written.read(key), tensors.get(key).to(torch.bfloat16)):
            raise CheckFailed(f"{path}: {key} does not read back as the source's tensor in bf16.",
                              hint="This is a flux-port bug; please report it with the command line.")
        tensors.release(key)
    for key, (err, _, norm) in quality.targets.items():
        source = tensors.get(key)
        again = 0.0
        step = max(1, BAND // source.shape[1])
        for a in range(0, source.shape[0], step):  # a band of rows at a time: the largest target is 0.6 GB fp32
            b = min(a + step, source.shape[0])
            again += float((written.read(key, (a, b)).float() - source[a:b].float()).double().pow(2).sum())
        tensors.release(key)
        if abs(math.sqrt(again) - math.sqrt(err)) > 1e-3 * math.sqrt(err) + 1e-6 * math.sqrt(norm):
            raise CheckFailed(f"{path}: {key} reads back with error {math.sqrt(again):.6g}; the writer meant "
                              f"{math.sqrt(err):.6g} (|W| {math.sqrt(norm):.6g}).",
                              hint="This is a flux-port bug; please report it with the command line.")
        worst = max(worst, (math.sqrt(again / norm) if norm else 0.0, key))
    for key, stored_norm in biases.items():
        diff = float((written.read(key).float() - tensors.get(key).float()).norm())
        tensors.release(key)
        if diff > 2**-8 * stored_norm + 1e-6:
            raise CheckFailed(f"{path}: bias {key} reads back {diff:.3g} away from the source; bf16 rounding of what "
                              f"was stored allows {2**-8 * stored_norm:.3g}.",
                              hint="This is a flux-port bug; please report it with the command line.")
    return {**read_as, "worst_rel_l2": worst[0], "worst_key": worst[1]}


class Calibrator(Protocol):
    """Runs the source for its per-channel input maxima (pipeline/calibrate.py: Calibration)."""

    base: Path

    def check(self, transformer: Path) -> None: ...
    def maxima(self, transformer: Path) -> dict[str, torch.Tensor]: ...
    def describe(self) -> str: ...


def convert_svdquant(src: SourceLike, out: str | Path, quantize: str, rank: int = 32,
                     config: str | Path | None = None, strict: bool = True, force: bool = False,
                     on_start: Callable[[int], None] | None = None, on_bytes: Callable[[int], None] | None = None,
                     tables: Mapping[str, MappingTable] | None = None, tensors: type[PlanTensors] = PlanTensors,
                     extra_meta: Mapping[str, Any] | None = None, verb: str = "convert",
                     calibrate: Calibrator | None = None, layout: str = "nunchaku") -> ConvertResult:
    """`tensors`: what hands the diffusers weights to the writer (merge --requantize folds deltas in on the way;
    those are used once, so its values are then not reread); `extra_meta` goes into the header metadata;
    `calibrate`: what runs the source in a base pipeline for calibrated smoothing (pipeline.calibrate.Calibration);
    `layout` "diffusers": the file written is then moved, exactly, into diffusers' own Nunchaku folder."""
    if layout == "diffusers":
        return _diffusers_layout(src, out, quantize, rank, config, strict, force, on_start, on_bytes, tables,
                                 tensors, extra_meta, verb, calibrate)
    precision = PRECISIONS[quantize]
    check_rank(rank)
    started = time.perf_counter()
    source = weights_source(src, config, tables)
    ckpt, detection, plan = plan_source(source, "diffusers", "keep")
    if strict and not plan.ok:
        raise strict_error(plan, src)
    stranded = stranded_sidecars(plan)
    if stranded is not None:
        raise stranded
    family = detection.table.name
    if family not in ("flux1", "flux2"):
        raise UsageError(f"--quantize {quantize}: {source.path} is a {family} model; Nunchaku SVDQuant files exist "
                         "for FLUX.1 and FLUX.2 [klein] only.")
    shapes = {key: shape for key, shape, _ in plan.outputs()}
    layout = L.plan_file(family, detection.config, shapes, str(source.path))
    need, breakdown = layer_memory(layout, shapes)
    require_memory(f"--quantize {quantize}", need, breakdown,
                   hint="Close other programs, or convert on a machine with more memory.")
    name = L.file_name(precision, rank, source.path)
    out = Path(out)
    read_paths = {"source": source.path, "--config": config, "--calibrate": calibrate and calibrate.base}
    if calibrate is not None:
        calibrate.check(source.path)
    check_output(out, force=force, verb=verb, inputs=read_paths)
    if on_start:
        on_start(plan.output_bytes)
    maxima = None
    smoothing = SMOOTHING
    if calibrate is not None:
        maxima = calibrate.maxima(source.path)
        smoothing = (f"calibrated: s_j = max|X_j|^{ALPHA:g} / max|W[:, j]|^{1 - ALPHA:g} (SmoothQuant), input maxima "
                     f"of {calibrate.describe()}, geometric mean 1")
    made = {"tool": "flux-port", "version": __version__, "smoothing": smoothing, "rank_asked": rank}
    meta = L.metadata(family, {**detection.config, "_class_name": detection.table.diffusers_class},
                      precision, rank, {"flux_port": made, **(extra_meta or {})})
    with atomic_folder(out, force=force, verb=verb, inputs=read_paths) as staging:
        quality = writer.write(staging / name, layout, precision, rank, tensors(ckpt, plan), meta, str(source.path),
                               maxima)
        again = PlanTensors(ckpt, plan) if tensors is PlanTensors else None
        checked = reread(staging / name, family, layout, quality, again, quality.biases)
        size = (staging / name).stat().st_size
        kinds = quality.by_kind()
        stored = L.padded(rank)
        asked = "" if stored == rank else f" (--rank {rank} padded to a multiple of 16)"
        extra = {"quantized_to": f"{writer.NAME} {precision}, rank {stored}{asked}", "file": name,
                 "file_sha256": _sha256(staging / name),
                 "stored_kinds": {k: v for k, v in _layer_counts(layout).items()}, "reread": checked,
                 "svdq": {"precision": precision, "rank": rank, "stored_rank": stored, "smoothing": smoothing,
                          "quality": kinds, "file_bytes": size, "bf16_bytes": plan.output_bytes}}
        manifest = {"tool": "flux-port", "version": __version__, "source": str(source.path.resolve()),
                    "source_naming": detection.naming_label, "table": family, "to": "nunchaku",
                    "variant": detection.variant, "files": [name], "config": detection.config, **extra}
        write_manifest(staging, manifest, ckpt, source)
    if on_bytes:
        on_bytes(plan.output_bytes)
    quant = ckpt.quantization.to_dict() if ckpt.quantization else None
    return ConvertResult(plan, out, [name], None, time.perf_counter() - started, quantization=quant, extra=extra)


def _diffusers_layout(src: SourceLike, out: str | Path, quantize: str, rank: int, config: str | Path | None,
                      strict: bool, force: bool, on_start: Callable[[int], None] | None,
                      on_bytes: Callable[[int], None] | None, tables: Mapping[str, MappingTable] | None,
                      tensors: type[PlanTensors], extra_meta: Mapping[str, Any] | None, verb: str,
                      calibrate: Calibrator | None) -> ConvertResult:
    """Nunchaku's file written next to `out`, then moved into diffusers' layout (`svdq_relayout`): its layers are
    joined exactly (the writer shares one smoothing between pieces that read the same input)."""
    import tempfile

    from .svdq_relayout import relayout

    out = Path(out)
    check_output(out, force=force, verb=verb, inputs={"source": getattr(src, "path", src)})
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.absolute().parent) as tmp:
        result = convert_svdquant(src, Path(tmp) / "nunchaku", quantize, rank, config, strict, False, on_start, None,
                                  tables, tensors, extra_meta, verb, calibrate)
        moved = relayout(Path(tmp) / "nunchaku" / result.files[0], out, "diffusers", force=force,
                         source=Path(getattr(src, "path", src)))
    if moved.extra["layout"]["requantized"]:
        raise CheckFailed(f"{out}: layer {moved.extra['layout']['requantized'][0]['layer']} of flux-port's own file "
                          "did not join exactly into diffusers' layout.",
                          hint="This is a flux-port bug; please report it with the command line.")
    if on_bytes:
        on_bytes(result.plan.output_bytes)
    result.out, result.files = out, moved.files
    joined = moved.extra["layout"]["rank"]
    result.extra.update(file=moved.files[0], layout=moved.extra["layout"], file_sha256=_sha256(out / moved.files[0]),
                        quantized_to=result.extra["quantized_to"] + f" in diffusers' Nunchaku layout (rank {joined}: "
                        "one rank for every target, joined layers carry their pieces' branches side by side)")
    return result


def _layer_counts(layout: L.FileLayout) -> dict[str, int]:
    out: dict[str, int] = {}
    for layer in layout.layers:
        kind = "W4A16 AWQ int4 g64" if layer.kind == "awq" else "W4A4 + low-rank branch"
        out[kind] = out.get(kind, 0) + 1
    return out


__all__ = ["PRECISIONS", "SMOOTHING", "PlanTensors", "convert_svdquant", "reread", "check_rank"]
