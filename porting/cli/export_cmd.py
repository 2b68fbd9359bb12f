"""`port export FOLDER --format onnx --out DIR`: one ONNX folder per component, with a manifest."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from porting.errors import PortError

from . import _output
from ._options import ForceOpt, JsonOpt, OutDirOpt, QuietOpt

EXPORT_EXAMPLES = """\b
Examples:
  port export ./my-klein-ft --format onnx --out ./my-klein-ft-onnx --dtype fp16
  port export ./transformer --format onnx --out ./onnx --components transformer --opset 23
  port validate ./my-klein-ft-onnx/transformer --runtime onnxruntime --provider CPUExecutionProvider
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
    folder: Annotated[Path, typer.Argument(help="Published diffusers pipeline folder, or a converted transformer "
                                           "folder.")],
    out: OutDirOpt,
    format_: Annotated[ExportFormat, typer.Option("--format", help="Target format.")] = ExportFormat.onnx,
    dtype: Annotated[ExportDtype, typer.Option("--dtype", help="Weights and compute dtype of the export (bf16 is "
                                               "refused: no CPU kernels in onnxruntime).")] = ExportDtype.fp32,
    opset: Annotated[Optional[int], typer.Option("--opset", help="ONNX opset (default 18; 23 fuses Attention and "
                                                 "RMSNormalization).")] = None,
    components: Annotated[Optional[str], typer.Option("--components", help="Comma-separated: transformer, "
                                                      "vae_decoder, text_encoder (default: all present).")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Export a diffusers folder to ONNX (weights as external data), ready for onnxruntime."""
    from porting.export.onnx import DEFAULT_OPSET, export_onnx

    output = _output.use(json_mode=json_, quiet=quiet, heavy=True)
    wanted = [c.strip() for c in components.split(",") if c.strip()] if components else None
    if components is not None and not wanted:
        raise PortError("--components is empty; name at least one of transformer, vae_decoder, text_encoder.")
    result = export_onnx(folder, out, dtype=dtype.value, opset=DEFAULT_OPSET if opset is None else opset,
                         components=wanted, force=force, on_status=output.status)
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
    if any(c.name == "transformer" for c in result.components):
        output.hint(f"validate it next: port validate {Path(result.out) / 'transformer'} --runtime onnxruntime "
                    "--provider CPUExecutionProvider")
