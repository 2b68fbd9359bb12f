"""`port convert SRC --out DIR`: rename and split weights through a mapping table, streaming."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from porting.errors import PortError

from . import _adapter, _output
from ._options import (
    Direction,
    DtypeChoice,
    ForceOpt,
    JsonOpt,
    OptionalOutDirOpt,
    QuietOpt,
    SvdqLayout,
    WorkspaceOpt,
    check_applicable,
    convert_given,
    convert_kind,
)
from ._source import resolve

if TYPE_CHECKING:
    from rich.table import Table

    from porting.engine.convert import ConvertResult
    from porting.inputs import Source

CONVERT_EXAMPLES = """\b
Examples:
  port convert Flux2-Klein-9B-True-bf16.safetensors --out ./transformer --strict
  port convert ft.safetensors --out ./transformer --config ./FLUX.2-klein-9B --strict
  port convert ./transformer --to original --out ./bfl
  port convert ft.safetensors --dry-run --json
  port convert klein-fp8_scaled.safetensors --out ./transformer      (dequantized to bf16)
  port convert ./transformer --to original --quantize gguf-q8_0 --out ./gguf
  port convert ft.safetensors --quantize svdq-int4 --rank 32 --out ./nunchaku   (data-free Nunchaku SVDQuant)
  port convert ./nunchaku/svdq-int4_r32-ft.safetensors --layout diffusers --out ./lite   (diffusers' Nunchaku)
  port convert flux2-klein-9b-true-v1          (a recipe fetched with port fetch: finetune/ -> transformer/)
  port convert my-lora.safetensors --out ./lora            (an adapter: diffusers / peft naming)
  port convert ./lora/pytorch_lora_weights.safetensors --to original --lora-style kohya --out ./comfy
"""


class QuantizeChoice(str, Enum):
    fp8_scaled = "fp8-scaled"
    gguf_q8_0 = "gguf-q8_0"
    gguf_q4_0 = "gguf-q4_0"
    svdq_int4 = "svdq-int4"
    svdq_nvfp4 = "svdq-nvfp4"
    awq_int4 = "awq-int4"


class LoraStyle(str, Enum):
    bfl = "bfl"
    kohya = "kohya"


def summary_table(result: ConvertResult) -> Table:
    from rich.table import Table

    s = result.plan.summary()
    table = Table(title="conversion plan", show_header=False)
    table.add_row("table", f"{s['table']} ({s['from']} -> {s['to']})")
    table.add_row("variant", s["variant"])
    if result.quantization:
        q = result.quantization
        table.add_row("dequantized from", f"{q['label']}" + (f"; dropped {len(q['dropped'])} tensor(s) "
                                                             f"({q['dropped'][0]}, ...)" if q["dropped"] else ""))
    table.add_row("tensors",
                  f"{s['source_tensors']} -> {s['target_tensors']} (target model: {s['target_model_tensors']})")
    table.add_row("parameters", f"{s['parameters']:,}")
    svdq = result.extra.get("svdq")
    if svdq:  # the file written, against the same weights in bf16 (the plan's output size)
        size, bf16 = svdq["file_bytes"], svdq["bf16_bytes"]
        table.add_row("output size", f"{size / 1e9:.3f} GB, {size / max(bf16, 1):.1%} of {bf16 / 1e9:.3f} GB in bf16")
    else:
        table.add_row("output size", f"{s['output_bytes'] / 1e9:.3f} GB")
    table.add_row("plan", "every key and shape accounted for" if s["ok"] else f"{len(s['problems'])} problem(s)")
    if svdq and result.extra.get("reread"):
        for label, text in svdq_rows(result.extra, svdq):
            table.add_row(label, text)
    elif result.extra.get("reread"):
        r = result.extra["reread"]
        table.add_row("quantized to", f"{result.extra['quantized_to']}: " + ", ".join(
            f"{k} x {v}" for k, v in sorted(result.extra["stored_kinds"].items())))
        table.add_row("reread", f"{r['layout']}; worst dequantized error {100 * r['worst_rel_l2']:.3g} % "
                                f"({r['worst_key']})")
    elif result.extra.get("quantize_to"):
        table.add_row("would write", f"{result.extra['quantize_to']}: {', '.join(result.extra['planned_files'])} "
                                     "(dry run: nothing written, nothing quantized)")
    if result.out:
        table.add_row("written", f"{result.out} ({', '.join(result.files)})")
        if result.weights_sha256:
            table.add_row("weights sha256", result.weights_sha256)
        if result.extra.get("file_sha256"):
            table.add_row("file sha256", result.extra["file_sha256"])
        table.add_row("time", f"{result.seconds:.1f} s")
    return table


def svdq_rows(extra: dict, svdq: dict) -> list[tuple[str, str]]:
    """`quantized to` and `reread` for an SVDQuant file, each saying what it counts: the layers stored in the file,
    and the diffusers tensors they read back as (Nunchaku stores q, k and v as one layer and some projections as
    two, so the numbers differ by design)."""
    layers, r = extra["stored_kinds"], extra["reread"]
    tensors = r.get("tensors", {})
    weights = sum(row["tensors"] for row in svdq["quality"].values())
    n_layers, n_tensors = sum(layers.values()), sum(tensors.values())
    kinds = ", ".join(f"{k} x {v}" for k, v in sorted(tensors.items()))
    why = "the file fuses q/k/v and splits some projections" + (
        ", and each bias is a tensor of its own" if n_tensors > weights else "")
    return [("quantized to", f"{extra['quantized_to']}: {n_layers} layers in the file (" + ", ".join(
                 f"{k} x {v}" for k, v in sorted(layers.items())) + ")"),
            ("reread", f"the {n_layers} layers read back as {n_tensors} diffusers tensors ({kinds}): {why}; worst "
                       f"dequantized error {100 * r['worst_rel_l2']:.3g} % ({r['worst_key'] or 'not reread'})")]


def _svdq_title(doc: dict) -> str:
    group = 64 if doc["precision"] == "int4" else 16
    rank = doc.get("stored_rank", doc["rank"])
    return (f"SVDQuant {doc['precision']} rank {rank}: weight error (relative L2) vs plain {doc['precision']} "
            f"g{group} rounding")


def svdq_summary(doc: dict) -> str:
    """The error table in one line: the range over layer kinds, the worst kind, plain rounding's range."""
    rows = doc["quality"]
    if not rows:
        return f"{_svdq_title(doc)}: no layer was quantized"
    ours = sorted((row["rel_error"], kind) for kind, row in rows.items())
    plain = sorted(row["plain_rel_error"] for row in rows.values())
    group = 64 if doc["precision"] == "int4" else 16
    return (f"SVDQuant {doc['precision']} rank {doc.get('stored_rank', doc['rank'])} weight error (relative L2): "
            f"{100 * ours[0][0]:.2f}-{100 * ours[-1][0]:.2f} % over {len(rows)} layer kinds (worst "
            f"{ours[-1][1]}); plain {doc['precision']} g{group} rounding {100 * plain[0]:.2f}-{100 * plain[-1]:.2f} "
            "%; --verbose prints each kind")


def svdq_table(doc: dict) -> Table:
    """Per layer kind: the file's weight error and plain 4-bit rounding's (same group size, no branch)."""
    from rich.table import Table

    table = Table(title=_svdq_title(doc))
    for column in ("weights", "layer", "tensors", "SVDQuant", "plain 4-bit"):
        table.add_column(column)
    for kind, row in doc["quality"].items():
        table.add_row(kind, row["layer"], str(row["tensors"]), f"{100 * row['rel_error']:.2f} %",
                      f"{100 * row['plain_rel_error']:.2f} %")
    return table  # the file size against bf16 is the conversion plan's `output size`


# long: the signature is convert's table of 18 options (each with its help); the body is 35 lines
def convert(
    src: Annotated[Path, typer.Argument(help="Checkpoint: .safetensors file, sharded folder, diffusers folder, or a "
                                        "recipe name in the workspace.")],
    out: OptionalOutDirOpt = None,
    to: Annotated[Direction, typer.Option("--to", help="Target naming.")] = Direction.diffusers,
    dtype: Annotated[DtypeChoice, typer.Option("--dtype", help="Cast weights on the way.")] = DtypeChoice.keep,
    config: Annotated[Optional[Path], typer.Option("--config", help="Base model folder or config.json the "
                                                   "checkpoint must fit.")] = None,
    max_shard_size: Annotated[Optional[str], typer.Option(
        "--max-shard-size", help="Largest output shard (default: 5GB shards for diffusers naming, one file for "
                                 "original naming, which ComfyUI, Forge and BFL's code need).")] = None,
    strict: Annotated[bool, typer.Option("--strict/--no-strict", help="Refuse unless every key and shape is "
                                         "accounted for.")] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan, write nothing.")] = False,
    quantize: Annotated[Optional[QuantizeChoice], typer.Option(
        "--quantize", help="With --to original: write one quantized file for ComfyUI (fp8-scaled) or "
                           "ComfyUI-GGUF / llama.cpp-style runtimes (gguf-q8_0, gguf-q4_0), reread and "
                           "report its error. svdq-int4 / svdq-nvfp4: one Nunchaku SVDQuant file (its own "
                           "naming, no --to), data-free, with the error per layer kind against plain 4-bit "
                           "rounding. awq-int4: a text encoder (Qwen3, T5) as Nunchaku's 4-bit file (AWQ W4A16, "
                           "group 128).")] = None,
    rank: Annotated[Optional[int], typer.Option("--rank", help="--quantize svdq-*: rank of the low-rank branch "
                                                "(default 32, as Nunchaku's files).")] = None,
    calibrate: Annotated[Optional[Path], typer.Option(
        "--calibrate", help="--quantize svdq-*: a base pipeline folder (text encoder, VAE) to run SRC, a diffusers "
                            "transformer folder, in on a few prompts; its per-channel input maxima set the "
                            "smoothing (default: data-free).")] = None,
    device: Annotated[str, typer.Option("--device", help="--calibrate: where the bf16 model runs.")] = "cpu",
    layout: Annotated[Optional[SvdqLayout], typer.Option(
        "--layout", help="SVDQuant's file layout. With --quantize svdq-*: nunchaku (default; one file, Nunchaku's "
                         "and ComfyUI-nunchaku's loaders) or diffusers (a transformer folder diffusers loads with its "
                         "Nunchaku Lite quantizer). Without --quantize, on an SVDQuant model: moves it into the other "
                         "layout without requantizing, where that is exact.")] = None,
    lora_style: Annotated[Optional[LoraStyle], typer.Option("--lora-style", help="Adapters with --to original: "
                                                            "BFL (diffusion_model.*.lora_A) or kohya keys.")] = None,
    materialise: Annotated[bool, typer.Option("--materialise", help="Adapters: write the exact delta of modules "
                                              "that have no exact factors in the target naming.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="--quantize svdq-*: the weight error of each "
                                          "layer kind as a table (default: a one-line summary).")] = False,
    force: ForceOpt = False,
    workspace: WorkspaceOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert FLUX.2 / FLUX.1 transformer weights (or a LoRA / LyCORIS adapter) between original (BFL) and
    diffusers naming."""
    output = _output.use(json_mode=json_, quiet=quiet)
    recipe, source, out, config = _open(src, workspace, out, config, output)
    src = source.path
    quantized = quantize.value if quantize is not None else None
    kind = _kind(source, quantized, layout)
    check_applicable("convert", kind, convert_given(
        lora_style=lora_style.value if lora_style else None, materialise=materialise, rank=rank, calibrate=calibrate,
        device=device, to=to.value, dtype=dtype.value, quantize=quantized, verbose=verbose,
        layout=layout.value if layout is not None else None),
        src=src, quantize=quantized, out="--dry-run" if dry_run else "--out DIR")
    if kind == "adapter":
        style = lora_style.value if lora_style else None
        return _adapter.convert(output, source, out, to.value, style, materialise, config, dry_run, force)
    if out is None and not (dry_run and kind not in ("awq", "relayout")):
        raise PortError("port convert needs --out DIR" + ("." if kind in ("awq", "relayout") else
                                                           " (or --dry-run to only print the plan)."))
    if kind in ("text_encoder", "awq"):
        from . import _text_encoder

        return _text_encoder.convert(output, source, out, quantized, strict, force, dry_run)
    if kind == "svdq":
        _check_rank(rank)
    with output.bytes_progress("converting") as (on_start, on_bytes):
        job = _Job(source, out, to, dtype, config, max_shard_size, strict, dry_run, force, on_start, on_bytes,
                   output.warning)
        if kind == "relayout":
            result = _relayout(job, layout.value if layout is not None else "")
        elif kind == "svdq":
            result = _convert_svdq(job, quantize.value, 32 if rank is None else rank, calibrate, device,
                                   layout.value if layout is not None else "nunchaku")
        elif kind == "quantized":
            result = _convert_quantized(job, quantize.value)
        else:
            result = _convert_plain(job)
    _report(output, result, recipe, to, verbose)


def _open(src: Path, workspace: Optional[Path], out: Optional[Path], config: Optional[Path],
          output: _output.Output) -> tuple[Any, Source, Optional[Path], Optional[Path]]:
    """SRC opened, with a recipe's own --out and --config defaults when SRC names a recipe in the workspace."""
    from ._recipe import as_recipe, base_config, finetune_file, raise_unfetched_recipe

    recipe = as_recipe(src, workspace)
    if recipe is not None:
        return recipe, resolve(src, output.status, path=finetune_file(recipe)), out or recipe.transformer, \
            config or base_config(recipe)
    if not src.exists():
        raise_unfetched_recipe(src)
    return None, resolve(src, output.status), out, config


@dataclass
class _Job:
    """What every conversion of weights is given."""
    source: Source
    out: Optional[Path]
    to: Direction
    dtype: DtypeChoice
    config: Optional[Path]
    max_shard_size: Optional[str]
    strict: bool
    dry_run: bool
    force: bool
    on_start: Callable[[int], None]
    on_bytes: Callable[[int], None]
    on_notice: Callable[[str], None]


def _convert_plain(job: _Job) -> ConvertResult:
    """The weights renamed (and cast) into `job.to`'s naming, or (a dry run) the plan."""
    from porting.engine.convert import convert as run_convert

    return run_convert(job.source, job.out, to=job.to.value, dtype=job.dtype.value, config=job.config,
                       max_shard_size=job.max_shard_size, strict=job.strict, dry_run=job.dry_run, force=job.force,
                       on_start=job.on_start, on_bytes=job.on_bytes, on_notice=job.on_notice, identity=False)


def _check_rank(rank: Optional[int]) -> None:
    from porting.engine.svdq_convert import check_rank

    check_rank(32 if rank is None else rank)


def _kind(source: Source, quantized: Optional[str], layout: Optional[SvdqLayout]) -> str:
    """`convert_kind`, and `relayout` for --layout on an SVDQuant model without --quantize."""
    kind = convert_kind(source.kind, quantized)
    return "relayout" if kind == "weights" and layout is not None and _is_svdq(source) else kind


def _relayout(job: _Job, layout: str) -> ConvertResult:
    """The SVDQuant model moved into `layout` (svdq_relayout)."""
    from porting.engine.svdq_relayout import relayout

    assert job.out is not None
    return relayout(job.source, job.out, layout, force=job.force, on_start=job.on_start, on_bytes=job.on_bytes)


def _is_svdq(source: Source) -> bool:
    """An SVDQuant model (Nunchaku's file or diffusers' Nunchaku folder), from its headers."""
    from porting.tensors.quant.svdq.reader import svdq_info

    return svdq_info(source.view) is not None


def _convert_svdq(job: _Job, quantize: str, rank: int, calibrate: Optional[Path], device: str,
                  layout: str = "nunchaku") -> ConvertResult:
    """One Nunchaku SVDQuant file (or diffusers' Nunchaku folder), or (a dry run) the plan of the diffusers weights
    and the file it would be."""
    if not job.dry_run:
        from porting.engine.svdq_convert import convert_svdquant
        from porting.pipeline.calibrate import Calibration

        return convert_svdquant(job.source, job.out, quantize, rank=rank, config=job.config, strict=job.strict,
                                force=job.force, on_start=job.on_start, on_bytes=job.on_bytes,
                                calibrate=None if calibrate is None else Calibration(calibrate, device),
                                layout=layout)
    from porting.engine.convert import convert as run_convert

    result = run_convert(job.source, None, to="diffusers", config=job.config, strict=job.strict, dry_run=True,
                         on_notice=job.on_notice)
    from porting.engine.svdq_convert import PRECISIONS
    from porting.tensors.quant.svdq.layout import file_name, padded

    stored = "" if padded(rank) == rank else f", stored as rank {padded(rank)}"
    result.extra.update(quantize_to=f"Nunchaku SVDQuant ({quantize}, rank {rank}{stored})",
                        planned_files=[file_name(PRECISIONS[quantize], rank, job.source.path)])
    return result


def _convert_quantized(job: _Job, quantize: str) -> ConvertResult:
    """One gguf / fp8 file in original naming, or (a dry run) the plan of the original-naming weights and the file
    it would be."""
    if not job.dry_run:
        from porting.engine.quantize import convert_quantized

        return convert_quantized(job.source, job.out, quantize, dtype=job.dtype.value, config=job.config,
                                 strict=job.strict, force=job.force, on_start=job.on_start, on_bytes=job.on_bytes)
    from porting.engine.convert import convert as run_convert
    from porting.engine.quantize import TARGETS

    result = run_convert(job.source, None, to="original", dtype=job.dtype.value, config=job.config,
                         strict=job.strict, dry_run=True, on_notice=job.on_notice)
    layout, name = TARGETS[quantize]
    result.extra.update(quantize_to=layout, planned_files=[name])
    return result


def _report(output: _output.Output, result: ConvertResult, recipe: Any, to: Direction, verbose: bool = False
            ) -> None:
    """Record the step in a recipe's workspace, print the document or the tables, the plan's problems and a hint."""
    if recipe is not None and result.out:
        from porting.hub.workspace import record_step
        record_step(recipe, "convert", result.to_dict())
    output.document(result.to_dict())
    if not output.json_mode:  # the tables (and rich) only for a reader
        output.table(summary_table(result))
        if result.extra.get("svdq") and verbose:
            output.table(svdq_table(result.extra["svdq"]))
        elif result.extra.get("svdq"):
            output.result(svdq_summary(result.extra["svdq"]))
    if not result.plan.ok:
        for row in result.plan.problems()[:20]:
            output.warning(f"{row['kind']}: {row['key']}")
    if result.out and to == Direction.diffusers and not output.quiet:
        output.hint(f"validate it next: port validate {result.out} --device {suggested_device()}")


def suggested_device() -> str:
    """The device a hint names: `validate_device()` when torch is loaded already; otherwise read off the system
    (torch_npu installed, a GPU driver's device files), since importing torch for one line of hint took longer than
    converting a small file from the page cache."""
    if "torch" in sys.modules:
        from porting.devices import validate_device

        return validate_device()
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu:0"
    if any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd")):
        return "cuda"
    return "cpu"
