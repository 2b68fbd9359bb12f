"""`port inspect PATH`: what a checkpoint is, from headers alone."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from . import _adapter, _output
from ._compat import companions_table, compatibility_table
from ._options import JsonOpt, check_applicable, transformer_of
from ._source import resolve

if TYPE_CHECKING:
    from porting.inputs import Source

INSPECT_EXAMPLES = """\b
Examples:
  port inspect flux-2-klein-9b.safetensors
  port inspect ./my-finetune/ --json
  port inspect my-lora.safetensors             (an adapter: naming, ranks, alphas, which base it fits)
  port inspect my-lora.safetensors --base flux-2-klein-9b.safetensors --strength 0.8
                                               (and what each module does to that base: flags a LoRA with no effect)
"""


def describe(src: Source | Path, base: Path | None = None) -> dict[str, Any]:
    """`port inspect WEIGHTS` as a document: `src` a path or its opened `Source`, `base` a pipeline folder."""
    from porting.compat import companions, facts_of, runtimes
    from porting.inputs import as_source

    source = as_source(src, kind="weights")
    path = source.path
    d = source.detection
    ckpt = d.ckpt
    info = {
        "path": str(path), "files": [str(f) for f in ckpt.files], "family": d.table.name,
        "naming": d.naming, "prefix": d.prefix, "variant": d.variant, "diffusers_class": d.table.diffusers_class,
        "tensors": len(ckpt.tensors), "parameters": ckpt.parameter_count, "bytes": ckpt.total_bytes,
        "dtypes": ckpt.dtypes(), "config": {k: v for k, v in d.config.items() if not k.startswith("_")},
        "container": ckpt.container,
        "quantization": ckpt.quantization.to_dict() if ckpt.quantization else None,
        "spelling": ({"saved_by": "ComfyUI", "respelled": len(d.respelled),
                      "example": next(iter(sorted(d.respelled.items())))} if d.respelled else None),
        "compatibility": [v.to_dict() for v in runtimes(facts_of(path, ckpt, d))],
    }
    if base is not None:
        info["companions"] = {"base": str(base), "checks": companions(base, d.config, d.family)}
    return info


def inspect(path: Annotated[Path, typer.Argument(
                help="A .safetensors or .gguf file, a sharded folder, a diffusers model folder or a pipeline folder.")],
            base: Annotated[Optional[Path], typer.Option(
                "--base", help="A base pipeline folder: check its text encoder, VAE and variant against this "
                               "transformer. For an adapter: the base checkpoint (file or folder) to measure each "
                               "module's delta against (read a tensor at a time).")] = None,
            strength: Annotated[Optional[float], typer.Option(
                "--strength", help="Adapter only, with --base: the strength the delta is measured at (default "
                                   "1).")] = None,
            json_: JsonOpt = False) -> None:
    """Show naming, family, variant, dtypes, counts, the inferred diffusers config and which runtimes load the file
    (reads headers only)."""
    from rich.table import Table

    out = _output.use(json_mode=json_)
    source = resolve(path, out.status)
    path = source.path
    check_applicable("inspect", source.kind, {"--strength": None if strength is None else "--strength",
                                              "--base": None if base is None else "--base"},
                     src=path, strength=f"{strength:g}" if strength is not None else None)
    if source.kind == "adapter":
        return _adapter.inspect(out, source, transformer_of(base, out.status) if base else None, strength)
    if source.kind == "text_encoder":
        from . import _text_encoder

        return _text_encoder.inspect(out, source)
    info = describe(source, base)
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
        details = quant.get("details") or {}
        if "w4a4_layers" in details:
            table.add_row("  layers", f"{details['w4a4_layers']} W4A4 ({details['precision']}), "
                                      f"{details['w4a16_layers']} W4A16 (AWQ int4), "
                                      f"{details['plain_16bit_linears']} 16-bit linear(s)")
            table.add_row("  names", f"{details['family']}, {details['spelling']} spelling")
            made = details.get("written_by")
            if made:
                table.add_row("  written by", f"{made.get('tool', '?')} {made.get('version', '')}: "
                                              f"{made.get('smoothing', '')}")
            for merged in details.get("merged_adapters", []):
                table.add_row("  merged", f"{merged.get('adapter', '?')} x{merged.get('strength', 1)} "
                                          f"({merged.get('format', '?')}, {merged.get('modules', '?')} module(s))")
        table.add_row("  convert", "writes the dequantized weights (bf16 unless --dtype says otherwise)")
    if info["spelling"]:
        old, new = info["spelling"]["example"]
        table.add_row("spelling", f"saved by ComfyUI: {info['spelling']['respelled']} norm scale(s) read as the "
                                  f"table spells them ({old} -> {new})")
    for k, v in info["config"].items():
        table.add_row(f"config.{k}", str(v))
    out.table(table)
    out.table(compatibility_table(info))
    if "companions" in info:
        out.table(companions_table(info["companions"]))
