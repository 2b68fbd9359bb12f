"""`port demo`: the whole path on a built-in tiny model, offline."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from ..convert import convert as run_convert
from ..tiny import TINY_FLUX2, write_random_checkpoint
from . import _output
from .inspect_cmd import describe


def demo(
    workdir: Annotated[Path, typer.Option("--workdir", help="Where the demo writes its files.")] = Path("demo-out"),
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Build a tiny random FLUX.2 [klein]-architecture fine-tune in original naming and port it."""
    out = _output.use(json_mode=json_)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    steps: dict[str, object] = {}

    src = write_random_checkpoint(workdir / "finetune" / "tiny-klein-finetune.safetensors", TINY_FLUX2, seed=1)
    out.result(f"[1/2] built a tiny FLUX.2 [klein] fine-tune in original (BFL) naming: {src}")
    info = describe(src)
    steps["inspect"] = info
    out.result(f"      inspect: {info['family']} {info['variant']}, naming {info['naming']}, "
               f"{info['tensors']} tensors, {info['parameters']:,} parameters, dtypes {info['dtypes']}")

    result = run_convert(src, workdir / "transformer", strict=True)
    steps["convert"] = result.to_dict()
    s = result.plan.summary()
    out.result(f"[2/2] convert --strict: {s['source_tensors']} -> {s['target_tensors']} tensors, every key and "
               f"shape accounted for; wrote {result.out}/{result.files[0]} (weights sha256 "
               f"{result.weights_sha256[:16]}...)")
    out.document(steps)
