"""`port merge BASE ADAPTER[:STRENGTH]... --out DIR`: bake LoRA / LyCORIS / diff adapters into base weights."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import _output
from ._options import ForceOpt, JsonOpt, OutDirOpt, QuietOpt, check_applicable, require_finite
from ._source import resolve

MERGE_EXAMPLES = """\b
Examples:
  port merge flux-2-klein-9b.safetensors style.safetensors --out ./merged
  port merge flux-2-klein-9b.safetensors style.safetensors:0.8 detail.safetensors:0.5 --out ./merged
  port merge flux-2-klein-9b.safetensors style.safetensors --out ./transformer --to diffusers
  port merge flux-2-klein-9b.safetensors dev-lora.safetensors --skip 'guidance_in*' --out ./merged
  port merge svdq-int4_r32-klein.safetensors style.safetensors --out ./merged   (onto the low-rank branch)
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
    max_shard_size: Annotated[Optional[str], typer.Option(
        "--max-shard-size", help="Largest output shard (default: 5GB shards for diffusers naming, one file for "
                                 "original naming, which ComfyUI, Forge and BFL's code need).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check where every adapter key lands, write "
                                          "nothing.")] = False,
    skip: Annotated[Optional[list[str]], typer.Option(
        "--skip", help="Drop adapter keys matching this glob on purpose (repeatable), e.g. 'guidance_in*' of a dev "
                       "LoRA on a klein base; what is dropped is listed and recorded in the manifest.")] = None,
    max_error: Annotated[Optional[float], typer.Option(
        "--max-error", help="SVDQuant base: largest relative error of the truncated SVD that turns a LoKr, LoHa or "
                            "full delta into low-rank factors (default 0.001; LoRAs are appended exactly).")] = None,
    requantize: Annotated[bool, typer.Option(
        "--requantize", help="SVDQuant base: fold the deltas into the weights and quantize again at the base's "
                             "rank, instead of appending them to the low-rank branch.")] = False,
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
    source = resolve(base, output.status, kind="weights")  # the one reading placement and writing share
    base = source.path
    from porting.adapters.svdq_merge import svdq_info

    check_applicable("merge", "svdq" if svdq_info(source.detection.ckpt) is not None else "weights",
                     {"--requantize": "--requantize" if requantize else None,
                      "--max-error": None if max_error is None else "--max-error"}, src=base)
    with output.bytes_progress("merging") as (on_start, on_bytes):
        result = run_merge(source, specs, out, to=None if to == MergeTarget.keep else to.value,
                           max_shard_size=max_shard_size, force=force, dry_run=dry_run,
                           on_start=on_start, on_bytes=on_bytes, on_notice=output.warning,
                           skip=skip or (), max_error=max_error, requantize=requantize)
    doc = {**result.to_dict(), "adapters": [{"path": str(p), "strength": s} for p, s in specs]}
    output.document(doc)
    output.table(summary_table(result))
    svdq = result.extra.get("svdq_merge")
    if svdq:
        output.status(f"SVDQuant branch: rank {svdq['base_rank']} -> {svdq['rank']} ({svdq['layers_extended']} "
                      f"layer(s) extended, every other layer padded with zeros)")
        for row in svdq["factorised"]:
            output.status(f"  {row['layer']}: delta factorised at rank {row['rank']}, relative error "
                          f"{row['rel_error']:.2e}")
        for layer in svdq["requantized"]:
            output.warning(f"{layer} is a W4A16 layer (no low-rank branch): its delta was folded in and that layer "
                           "quantized again")
    effect = result.extra.get("adapter_effect")
    if effect:
        from porting.adapters.effect import summary_lines

        lines = summary_lines(effect)
        for line in lines:
            output.status(line)
        if any(r["status"] != "ok" for r in effect["modules"]):
            output.warning(lines[0].split(": ", 1)[1] + "; see the lines above or --json (adapter_effect)")
    for path, keys in result.extra.get("skipped", {}).items():
        output.warning(f"skipped {len(keys)} key(s) of {path} (--skip): {', '.join(keys[:6])}"
                       + (f" and {len(keys) - 6} more" if len(keys) > 6 else ""))
    names = ", ".join(f"{p.name} x{s:g}" for p, s in specs)
    output.result(f"merged {names} into {base.name}" + (f" -> {result.out}" if result.out else " (dry run)"))
