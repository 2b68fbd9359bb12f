"""`port merge BASE ADAPTER[:STRENGTH]... --out DIR`: bake LoRA / LyCORIS / diff adapters into base weights."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from . import _output
from ._options import ForceOpt, JsonOpt, OutDirOpt, QuietOpt, require_finite

MERGE_EXAMPLES = """\b
Examples:
  port merge flux-2-klein-9b.safetensors style.safetensors --out ./merged
  port merge flux-2-klein-9b.safetensors style.safetensors:0.8 detail.safetensors:0.5 --out ./merged
  port merge flux-2-klein-9b.safetensors style.safetensors --out ./transformer --to diffusers
"""


class MergeTarget(str, Enum):
    keep = "keep"
    diffusers = "diffusers"
    original = "original"


def merge(
    base: Annotated[Path, typer.Argument(help="Base checkpoint: .safetensors file, sharded folder or diffusers "
                                         "folder.")],
    adapters: Annotated[list[str], typer.Argument(help="Adapter files, each optionally FILE:STRENGTH (default 1).")],
    out: OutDirOpt,
    to: Annotated[MergeTarget, typer.Option("--to", help="Naming of the output: the base's (keep), or convert on "
                                            "the way.")] = MergeTarget.keep,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest output shard.")] = "5GB",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check where every adapter key lands, write "
                                          "nothing.")] = False,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Add adapter deltas (W + strength * alpha / rank * B @ A; LoKr, LoHa, diff) to a base, in its dtype.

    Every adapter key must land on a base tensor of the right shape, or nothing is written (exit 1).
    """
    from porting.adapters.merge import merge as run_merge
    from porting.adapters.merge import parse_strength

    from .convert_cmd import summary_table

    output = _output.use(json_mode=json_, quiet=quiet)
    specs = [parse_strength(a) for a in adapters]
    for text, (_, strength) in zip(adapters, specs):
        require_finite(strength, f"ADAPTER:STRENGTH {text!r}: strength")
    with output.bytes_progress("merging") as (on_start, on_bytes):
        result = run_merge(base, specs, out, to=None if to == MergeTarget.keep else to.value,
                           max_shard_size=max_shard_size, force=force, dry_run=dry_run,
                           on_start=on_start, on_bytes=on_bytes)
    doc = {**result.to_dict(), "adapters": [{"path": str(p), "strength": s} for p, s in specs]}
    output.document(doc)
    output.table(summary_table(result))
    names = ", ".join(f"{p.name} x{s:g}" for p, s in specs)
    output.result(f"merged {names} into {base.name}" + (f" -> {result.out}" if result.out else " (dry run)"))
