"""`port export FOLDER --format onnx --out DIR`: one ONNX folder per component, with a manifest."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from porting.errors import CheckFailed, PortError, UsageError

from . import _output
from ._options import ExportTarget, ForceOpt, JsonOpt, OptionalOutDirOpt, QuietOpt, at_least, power_of_two_at_least

EXPORT_EXAMPLES = """\b
Examples:
  port export ./my-klein-ft --format onnx --out ./my-klein-ft-onnx --dtype fp16
  port export ./transformer --format onnx --out ./onnx --components transformer --opset 23
  port validate ./my-klein-ft-onnx/transformer --runtime onnxruntime --provider CPUExecutionProvider
  port export ./my-klein-ft --format onnx --target ryzenai --size 1024 --text-len 512 --out ./klein-ryzenai
  port export ./my-klein-ft --format onnx --target ryzenai --size 512 --size 1024 --out ./klein-ryzenai-2
  port export --check ./klein-ryzenai --target ryzenai
"""


class ExportFormat(str, Enum):
    onnx = "onnx"


class ExportDtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"  # accepted by the parser so that the refusal can say why


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def export(
    folder: Annotated[Optional[Path], typer.Argument(help="Published diffusers pipeline folder, or a converted "
                                                     "transformer folder.")] = None,
    out: OptionalOutDirOpt = None,
    format_: Annotated[ExportFormat, typer.Option("--format", help="Target format.")] = ExportFormat.onnx,
    dtype: Annotated[ExportDtype, typer.Option("--dtype", help="Weights and compute dtype of the export (bf16 is "
                                               "refused: no CPU kernels in onnxruntime).")] = ExportDtype.fp32,
    opset: Annotated[Optional[int], typer.Option("--opset", help="ONNX opset (default 18; 23 fuses Attention and "
                                                 "RMSNormalization).")] = None,
    components: Annotated[Optional[str], typer.Option("--components", help="Comma-separated: transformer, "
                                                      "vae_decoder, text_encoder, text_encoder_2 where the "
                                                      "pipeline has one (default: all the model's family "
                                                      "exports).")] = None,
    target: Annotated[ExportTarget, typer.Option("--target", help="generic: dynamic axes, opset 18+; ryzenai: "
                                                 "AMD Ryzen AI NPU form (opset 17, static shapes, bf16 transformer, "
                                                 "int4 text encoder).")] = ExportTarget.generic,
    size: Annotated[Optional[List[int]], typer.Option("--size", help="ryzenai: image size in pixels, a multiple "
                                                      "of 16 (default 1024); give it several times for one "
                                                      "transformer and VAE decoder graph per size, all reading one "
                                                      "weights file.")] = None,
    text_len: Annotated[Optional[int], typer.Option("--text-len", callback=at_least(1), help="ryzenai: text "
                                                    "tokens (default 512).")] = None,
    block_size: Annotated[Optional[int], typer.Option("--block-size", callback=power_of_two_at_least(16),
                                                      help="ryzenai: int4 block size of the text encoder's "
                                                      "MatMulNBits, a power of two >= 16 (default 128).")] = None,
    accuracy_level: Annotated[Optional[int], typer.Option("--accuracy-level", help="ryzenai: MatMulNBits "
                                                          "accuracy_level 0-4 (default: unset).")] = None,
    check: Annotated[Optional[Path], typer.Option("--check", help="Lint an ONNX folder against --target instead "
                                                  "of exporting (exit 1 on findings).")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Export a diffusers folder to ONNX (weights as external data), ready for onnxruntime; or lint one (--check)."""
    preflight(folder=folder, out=out, check=check)
    output = _output.use(json_mode=json_, quiet=quiet, heavy=True)
    if check is not None:
        return _check(check, target.value, output)
    profile = _profile(target, dtype, size, text_len, block_size, accuracy_level)
    wanted = _components(components)
    from porting.export.onnx import export_onnx
    from porting.progress import TimedSteps

    steps = TimedSteps(None if output.quiet else output.err)
    try:
        result = export_onnx(folder, out, dtype=dtype.value, opset=opset, components=wanted, force=force,
                             on_status=steps, target=target.value, profile=profile)
    finally:
        steps.end()
    _report(output, result, target)


def preflight(*, folder: Optional[Path], out: Optional[Path], check: Optional[Path],
              target: ExportTarget = ExportTarget.generic, dtype: ExportDtype = ExportDtype.fp32,
              size: Optional[List[int]] = None, text_len: Optional[int] = None, block_size: Optional[int] = None,
              accuracy_level: Optional[int] = None, components: Optional[str] = None, opset: Optional[int] = None,
              **_: Any) -> None:
    """export's refusals that need no model (what is given with --check, the dtype, the ryzenai opset, sizes and
    settings, an empty --components), before any model library is imported (`_options.checked` runs it)."""
    if check is not None:
        if folder is not None or out is not None:
            raise UsageError("--check DIR lints a folder; give no FOLDER or --out with it.")
        return
    if folder is None or out is None:
        raise UsageError("port export needs FOLDER and --out (or --check DIR to lint a folder).")
    from porting.export.options import check_dtype, check_ryzenai_opset

    _profile(target, dtype, size, text_len, block_size, accuracy_level)
    if target is ExportTarget.ryzenai:
        check_ryzenai_opset(opset)
    else:
        check_dtype(dtype.value)
    _components(components)


def _components(components: Optional[str]) -> Optional[list[str]]:
    wanted = [c.strip() for c in components.split(",") if c.strip()] if components else None
    if components is not None and not wanted:
        raise PortError("--components is empty; name at least one of transformer, vae_decoder, text_encoder, "
                        "text_encoder_2.")
    return wanted


def _profile(target: ExportTarget, dtype: ExportDtype, size: Optional[List[int]], text_len: Optional[int],
             block_size: Optional[int], accuracy_level: Optional[int]) -> Any:
    """The ryzenai profile (sizes, text length, int4 block size), checked; None for the generic export, which takes
    none of its options."""
    if target is ExportTarget.ryzenai:
        from porting.export import options as ryzenai

        if dtype is not ExportDtype.fp32:
            raise UsageError(f"--dtype {dtype.value}: --target ryzenai sets the dtypes itself (bf16-cast transformer "
                             "and VAE decoder, int4 text encoder); leave --dtype out.")
        return ryzenai.check_profile(size or [ryzenai.DEFAULT_SIZE],
                                     ryzenai.DEFAULT_TEXT_LEN if text_len is None else text_len,
                                     ryzenai.DEFAULT_BLOCK_SIZE if block_size is None else block_size,
                                     accuracy_level)
    ryzenai_options = {"--size": size or None, "--text-len": text_len, "--block-size": block_size,
                       "--accuracy-level": accuracy_level}
    given = [k for k, v in ryzenai_options.items() if v is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: only with --target ryzenai (the generic export has dynamic axes "
                         "and float weights).")
    return None


def _report(output: _output.Output, result: Any, target: ExportTarget) -> None:
    """The document, a table of the components written, the notices and the next step."""
    from rich.table import Table

    output.document(result.to_dict())
    table = Table(title=f"exported to {result.out} (ONNX opset {result.opset_produced}, {result.dtype})")
    for col in ("component", "inputs", "parameters", "graph", "external data", "time"):
        table.add_column(col)
    for c in result.components:
        table.add_row(c.name, ", ".join(c.inputs), f"{c.params:,}", _gb(c.onnx_bytes), _gb(c.data_bytes),
                      f"{c.export_s:.1f} s")
    output.table(table)
    for notice in result.notices:
        output.warning(notice)
    if target is ExportTarget.ryzenai:
        todo = [f"port validate {Path(result.out) / c.name} --runtime onnxruntime" for c in result.components
                if c.name in ("transformer", "text_encoder")]
        if todo:
            output.hint("validate it next: " + "; ".join(todo))
    elif any(c.name == "transformer" for c in result.components):
        output.hint(f"validate it next: port validate {Path(result.out) / 'transformer'} --runtime onnxruntime "
                    "--provider CPUExecutionProvider")


def _check(folder: Path, target: str, output: _output.Output) -> None:
    from rich.table import Table

    from porting.export.lint import lint

    result = lint(folder, target)
    output.document(result.to_dict())
    table = Table(title=f"port export --check {folder} --target {target}: "
                        + ("PASS" if result.ok else f"{len(result.findings)} finding(s)"))
    for col in ("file", "check", "finding"):
        table.add_column(col)
    for f in result.findings:
        table.add_row(f.file, f.check, f.detail)
    if not result.findings:
        table.add_row(", ".join(result.files), "all", "no finding")
    output.table(table)
    if result.findings:
        raise CheckFailed(f"{folder}: {len(result.findings)} finding(s) against --target {target}; first: "
                          f"{result.findings[0].file}: {result.findings[0].check}: {result.findings[0].detail}.",
                          hint="Export with port export FOLDER --format onnx --target " + target + " --out DIR.")
