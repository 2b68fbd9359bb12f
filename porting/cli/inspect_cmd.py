"""`port inspect PATH`: what a checkpoint is, from headers alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from . import _adapter, _output
from ._options import JsonOpt

INSPECT_EXAMPLES = """\b
Examples:
  port inspect flux-2-klein-9b.safetensors
  port inspect ./my-finetune/ --json
  port inspect my-lora.safetensors             (an adapter: naming, ranks, alphas, which base it fits)
"""


def describe(path: Path) -> dict[str, Any]:
    from porting.engine.detect import detect
    from porting.tensors.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    d = detect(ckpt)
    return {
        "path": str(path), "files": [str(f) for f in ckpt.files], "family": d.table.name,
        "naming": d.naming, "prefix": d.prefix, "variant": d.variant, "diffusers_class": d.table.diffusers_class,
        "tensors": len(ckpt.tensors), "parameters": ckpt.parameter_count, "bytes": ckpt.total_bytes,
        "dtypes": ckpt.dtypes(), "config": {k: v for k, v in d.config.items() if not k.startswith("_")},
        "container": ckpt.container,
        "quantization": ckpt.quantization.to_dict() if ckpt.quantization else None,
    }


def inspect(path: Annotated[Path, typer.Argument(
                help="A .safetensors file, a sharded folder or a diffusers model folder.")],
            json_: JsonOpt = False) -> None:
    """Show naming, family, variant, dtypes, counts and the inferred diffusers config (reads headers only)."""
    out = _output.use(json_mode=json_)
    if _adapter.is_adapter(path):
        return _adapter.inspect(out, path)
    info = describe(path)
    out.document(info)
    table = Table(title=f"{path}", show_header=False)
    for key in ("family", "naming", "prefix", "variant", "diffusers_class", "tensors"):
        table.add_row(key, str(info[key]) if info[key] != "" else "(none)")
    table.add_row("parameters", f"{info['parameters']:,}")
    table.add_row("size", f"{info['bytes'] / 1e9:.2f} GB")
    table.add_row("dtypes", ", ".join(f"{k}: {v}" for k, v in info["dtypes"].items()))
    quant = info["quantization"]
    if quant:
        table.add_row("quantization", quant["format"])
        for scheme, count in quant["layers"].items():
            table.add_row("  dequantized", f"{count} tensor(s) {scheme}")
        if quant["folded"]:
            table.add_row("  folded", f"{quant['folded']} scale tensor(s) into the weights")
        if quant["dropped"]:
            table.add_row("  dropped", f"{len(quant['dropped'])} tensor(s), e.g. {quant['dropped'][0]}: "
                                       f"{quant['dropped_why']}")
        for note in quant["notes"]:
            table.add_row("  note", note)
        table.add_row("  convert", "writes the dequantized weights (bf16 unless --dtype says otherwise)")
    for k, v in info["config"].items():
        table.add_row(f"config.{k}", str(v))
    out.table(table)
