"""A text-encoder checkpoint (Nunchaku's 4-bit Qwen3 or T5) written as a bf16 transformers folder.

The folder is what `from_pretrained` of the file's own class reads: `config.json` (the config in the file's
metadata, `architectures` set) and `model.safetensors`, every 4-bit linear dequantized in float32 (W = q * scales +
scaled_zeros) and rounded once to bf16, every other tensor copied as stored. `strict` holds the file's keys and
shapes to the architecture built from that config (no missing, no unexpected key), as the loaders do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from porting import __version__
from porting.errors import PlanError
from porting.finite import check_tensor, dumps
from porting.inputs import Source, SourceLike, as_source
from porting.inputs.text_encoders import TextEncoder
from porting.outputs import atomic_folder, check_output
from porting.tensors.writer import Entry, WeightsHasher, write_shards

MANIFEST = "flux-port.json"
STEM = "model"
SHARD = 5 * 10**9  # what transformers' save_pretrained shards at
BLOCK_ROWS = 4096  # rows of a 4-bit linear dequantized at a time


@dataclass
class TextEncoderResult:
    encoder: TextEncoder
    out: Path | None
    tensors: int
    output_bytes: int
    missing: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    unexpected: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    weights_sha256: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def expected_shapes(encoder: TextEncoder) -> dict[str, tuple[int, ...]]:
    """The state dict (persistent parameters and buffers) of the architecture built from the file's config,
    without memory."""
    import warnings

    import transformers

    from porting.skeleton import empty_weights

    arch = encoder.architecture
    config_class = getattr(transformers, arch.config_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**{k: v for k, v in encoder.config.items() if k not in ("architectures",
                                                                                       "model_type")})
        with empty_weights():
            model = getattr(transformers, encoder.model_class)(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def account(result: TextEncoderResult, have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> None:
    # tied weights (T5's encoder.embed_tokens is shared.weight) are one stored tensor under its first name
    result.missing = [(k, s) for k, s in want.items() if k not in have and not _tied(k, want)]
    result.unexpected = [(k, s) for k, s in have.items() if k not in want]
    result.mismatched = [(k, have[k], want[k]) for k in have if k in want and have[k] != want[k]]


def _tied(key: str, want: dict[str, tuple[int, ...]]) -> bool:
    return key == "encoder.embed_tokens.weight" and "shared.weight" in want


def _tensors(source: Source, keys: list[str]) -> Iterator[Any]:
    import torch

    view = source.view
    for key in keys:
        info = view.tensors[key]
        if info.computed:
            rows = info.shape[0]
            blocks = [view.read(key, (a, min(a + BLOCK_ROWS, rows)), dtype=torch.bfloat16)
                      for a in range(0, rows, BLOCK_ROWS)]
            t = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        else:
            t = view.read(key)
        check_tensor(t, repr(key), source.path, hint="The 4-bit file is damaged; use another copy.")
        yield t.contiguous()


def _dtype(source: Source, key: str) -> str:
    info = source.view.tensors[key]
    return "BF16" if info.computed else info.dtype


def convert_text_encoder(src: SourceLike, out: str | Path | None, strict: bool = True, force: bool = False,
                         on_start: Callable[[int], None] | None = None,
                         on_bytes: Callable[[int], None] | None = None) -> TextEncoderResult:
    """Write the text encoder `src` as a bf16 transformers folder at `out` (None: plan only)."""
    started = time.perf_counter()
    source = as_source(src, kind="text_encoder")
    encoder = source.text_encoder
    have = {k: tuple(i.shape) for k, i in source.view.tensors.items()}
    keys = list(have)
    entries = [Entry(k, have[k], _dtype(source, k)) for k in keys]
    result = TextEncoderResult(encoder, None, len(entries), sum(e.nbytes for e in entries))
    account(result, have, expected_shapes(encoder))
    if strict and not result.ok:
        raise strict_error(source, result)
    if out is None:
        result.seconds = time.perf_counter() - started
        return result
    out = Path(out)
    read_paths = {"source": source.path}
    check_output(out, force=force, verb="convert", inputs=read_paths)
    if on_start:
        on_start(result.output_bytes)
    hasher = WeightsHasher()
    with atomic_folder(out, force=force, verb="convert", inputs=read_paths) as staging:
        result.files = write_shards(staging, STEM, entries, _tensors(source, keys), SHARD, metadata={"format": "pt"},
                                    on_bytes=on_bytes, hasher=hasher)
        config = {**encoder.config, "architectures": [encoder.model_class], "torch_dtype": "bfloat16"}
        (staging / "config.json").write_text(dumps(config, indent=2, sort_keys=True) + "\n")
        quant = source.view.quantization.to_dict() if source.view.quantization else None
        manifest = {"tool": "flux-port", "version": __version__, "format_version": 1,
                    "source": str(source.path.resolve()), "kind": "text_encoder",
                    "architecture": encoder.model_class, "tensors": len(entries),
                    "files": result.files, "weights_sha256": hasher.hexdigest(),
                    "dtype": "bf16", "dequantized_from": quant and quant["label"], "quantization": quant,
                    "quantized_layers": len(encoder.quantized), "group_size": encoder.group}
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
        source.check_unchanged()
    result.out, result.weights_sha256 = out, hasher.hexdigest()
    result.seconds = time.perf_counter() - started
    return result


def strict_error(source: Source, result: TextEncoderResult) -> PlanError:
    first = (f"missing {result.missing[0][0]!r} {list(result.missing[0][1])}" if result.missing else
             f"unexpected {result.unexpected[0][0]!r}" if result.unexpected else
             f"{result.mismatched[0][0]!r} is {list(result.mismatched[0][1])}, the architecture has "
             f"{list(result.mismatched[0][2])}")
    return PlanError(f"{source.path}: --strict: the tensors do not make a {result.encoder.model_class} of "
                     f"its config: {len(result.missing)} missing, {len(result.unexpected)} unexpected, "
                     f"{len(result.mismatched)} of another shape (first: {first}). Nothing was written.",
                     hint="Its loaders refuse such a file too; --no-strict writes what is there.")


__all__ = ["TextEncoderResult", "convert_text_encoder", "expected_shapes", "MANIFEST"]
