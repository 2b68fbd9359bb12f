"""What `port inspect` and `port convert` do with a text-encoder checkpoint (Nunchaku's 4-bit Qwen3 or T5, or a
transformers text encoder folder): the verbs hand an opened `Source` of kind `text_encoder` here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _output

if TYPE_CHECKING:
    from porting.inputs import Source

AFTER_CONVERT = "transformers from_pretrained of the converted bf16 folder (any device)"


def describe(source: Source) -> dict[str, Any]:
    """`port inspect TEXT_ENCODER` as a document."""
    te = source.text_encoder
    view = source.view
    quant = view.quantization.to_dict() if view.quantization else None
    four_bit = bool(te.quantized)
    loads = list(te.architecture.runtimes) if four_bit else [f"transformers {te.model_class}.from_pretrained"]
    return {
        "path": str(source.path), "kind": "text_encoder", "architecture": te.architecture.name,
        "what": te.architecture.label, "model_class": te.model_class, "layers": te.layers,
        "tensors": len(view.stored_tensors), "parameters": view.parameter_count, "bytes": view.total_bytes,
        "dtypes": view.dtypes(), "quantization": quant,
        "four_bit": ({"format": "AWQ W4A16 (TinyChat layout)", "group_size": te.group,
                      "layers": len(te.quantized), "examples": list(te.quantized[:3])} if four_bit else None),
        "pipeline": te.architecture.pipelines,
        "loaded_by": loads + ([AFTER_CONVERT] if four_bit else []),
        "config": {k: v for k, v in te.config.items() if not k.startswith("_") and not isinstance(v, (dict, list))},
    }


def inspect(out: _output.Output, source: Source) -> None:
    from rich.table import Table

    info = describe(source)
    out.document(info)
    table = Table(title=str(source.path), show_header=False)
    table.add_row("kind", f"text encoder: {info['what']}")
    table.add_row("layers", str(info["layers"]))
    table.add_row("tensors", f"{info['tensors']} stored")
    table.add_row("parameters", f"{info['parameters']:,}")
    table.add_row("size", f"{info['bytes'] / 1e9:.2f} GB")
    table.add_row("dtypes", ", ".join(f"{k}: {v}" for k, v in info["dtypes"].items()))
    four = info["four_bit"]
    if four:
        table.add_row("quantization", f"{four['format']}, group {four['group_size']}")
        table.add_row("  4-bit", f"{four['layers']} linear(s), e.g. {', '.join(four['examples'])}")
        table.add_row("  convert", "writes the dequantized bf16 folder (W = q * scales + scaled_zeros)")
    table.add_row("pipeline", info["pipeline"])
    for i, who in enumerate(info["loaded_by"]):
        table.add_row("loaded by" if i == 0 else "", who)
    for k, v in info["config"].items():
        table.add_row(f"config.{k}", str(v))
    out.table(table)


def convert(out: _output.Output, source: Source, dest: Path | None, quantize: str | None, strict: bool,
            force: bool, dry_run: bool) -> None:
    """`port convert TEXT_ENCODER --out DIR` (bf16 folder) or `--quantize awq-int4` (Nunchaku's 4-bit file)."""
    if quantize == "awq-int4":
        from porting.engine.awq_quantize import quantize_text_encoder

        with out.bytes_progress("quantizing") as (on_start, on_bytes):
            r = quantize_text_encoder(source, dest, force=force, on_start=on_start, on_bytes=on_bytes)
        out.document({"kind": "text_encoder", "out": str(r.out), "file": r.file, "to": "awq-int4",
                      "architecture": r.encoder.architecture.model_class, "quantized_layers": r.layers,
                      "group_size": 128, "file_bytes": r.output_bytes, "bf16_bytes": r.bf16_bytes,
                      "dropped": r.dropped, "worst_rel_l2": r.worst_rel_l2, "worst_layer": r.worst_layer,
                      "seconds": r.seconds})
        out.result(f"{source.path} -> {r.out / r.file}: {r.layers} linear(s) AWQ W4A16 int4 g128, "
                   f"{r.output_bytes / 1e9:.2f} GB ({r.output_bytes / max(r.bf16_bytes, 1):.0%} of bf16); worst "
                   f"layer {100 * r.worst_rel_l2:.2f} % ({r.worst_layer})"
                   + (f"; left out {', '.join(r.dropped)} (the loaders build the bare model)" if r.dropped else ""))
        out.hint(f"inspect it: port inspect {r.out / r.file}")
        return
    from porting.engine.text_encoder import convert_text_encoder

    with out.bytes_progress("converting") as (on_start, on_bytes):
        r = convert_text_encoder(source, None if dry_run else dest, strict=strict, force=force,
                                 on_start=on_start, on_bytes=on_bytes)
    doc = {"kind": "text_encoder", "out": None if r.out is None else str(r.out), "files": r.files,
           "architecture": r.encoder.model_class, "tensors": r.tensors, "output_bytes": r.output_bytes,
           "quantized_layers": len(r.encoder.quantized), "ok": r.ok,
           "missing": [k for k, _ in r.missing], "unexpected": [k for k, _ in r.unexpected],
           "mismatched": [k for k, _, _ in r.mismatched], "weights_sha256": r.weights_sha256, "seconds": r.seconds}
    out.document(doc)
    what = f"{r.tensors} tensors, every key and shape of {r.encoder.model_class} accounted for" if r.ok else (
        f"{r.tensors} tensors; {len(r.missing)} missing, {len(r.unexpected)} unexpected, {len(r.mismatched)} of "
        "another shape (--no-strict)")
    target = "(dry run: nothing written)" if r.out is None else f"-> {r.out} (bf16)"
    out.result(f"{source.path}: {what} {target}")
    if r.out is not None:
        out.hint(f"load it: {r.encoder.model_class}.from_pretrained('{r.out}') ({r.encoder.architecture.pipelines})")


__all__ = ["describe", "inspect", "convert"]
