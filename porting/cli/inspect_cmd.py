"""`port inspect PATH`: what a checkpoint is, from headers alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from porting.engine.detect import detect
from porting.tensors.checkpoint import open_checkpoint

from . import _adapter, _output
from ._options import JsonOpt

INSPECT_EXAMPLES = """\b
Examples:
  port inspect flux-2-klein-9b.safetensors
  port inspect ./my-finetune/ --json
  port inspect my-lora.safetensors             (an adapter: naming, ranks, alphas, which base it fits)
"""


def describe(path: Path) -> dict[str, Any]:
    ckpt = open_checkpoint(path)
    d = detect(ckpt)
    return {
        "path": str(path), "files": [str(f) for f in ckpt.files], "family": d.table.name,
        "naming": d.naming, "prefix": d.prefix, "variant": d.variant, "diffusers_class": d.table.diffusers_class,
        "tensors": len(ckpt.tensors), "parameters": ckpt.parameter_count, "bytes": ckpt.total_bytes,
        "dtypes": ckpt.dtypes(), "config": {k: v for k, v in d.config.items() if not k.startswith("_")},
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
    for k, v in info["config"].items():
        table.add_row(f"config.{k}", str(v))
    out.table(table)
