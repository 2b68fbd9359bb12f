"""`port convert TE_FOLDER --quantize awq-int4`: a text encoder written as Nunchaku's 4-bit file (AWQ W4A16, the
TinyChat layout its loaders read), data-free.

Each linear of the architecture's list is quantized on its own, asymmetric min-max per (output row, group of 128
inputs): the scale and zero point are rounded to bf16 first and the codes computed against the rounded values, so
the file's W = q * scales + scaled_zeros is the nearest the stored numbers allow. One layer is held at a time (its
float32 copy and its codes), so a Qwen3-8B fits a 24 GiB machine. Names are the bare model's (a
Qwen3ForCausalLM folder's `model.` prefix removed, its `lm_head` left out: the loaders build a Qwen3Model, and the
pipelines read hidden states only); the metadata is what the loaders read (shared/nunchaku-dialects.md section 1).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from porting import __version__
from porting.errors import UsageError
from porting.finite import check_tensor, dumps
from porting.inputs import Source, SourceLike, as_source
from porting.inputs.text_encoders import TextEncoder
from porting.outputs import atomic_folder, check_output
from porting.tensors.quant.awq_w4a16 import GROUP_SIZES, padded_groups
from porting.tensors.writer import Entry, write_shards

MANIFEST = "flux-port.json"
GROUP = 128  # the CUDA gemm_awq kernel's only group; nunchaku's T5 loader has it fixed


@dataclass
class AwqResult:
    encoder: TextEncoder
    out: Path | None
    file: str
    layers: int
    tensors: int
    output_bytes: int
    bf16_bytes: int
    worst_rel_l2: float = 0.0
    worst_layer: str = ""
    dropped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def file_name(source: Path) -> str:
    """`awq-int4-NAME.safetensors`: the name tonera's injector looks for (`^(svdq|awq)-(fp4|int4)-.+`)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source.name.removesuffix(".safetensors")).strip("-.") or "text-encoder"
    return f"awq-int4-{stem}.safetensors"


def metadata(encoder: TextEncoder, group: int) -> dict[str, str]:
    """The header metadata the loaders read: `config` (Qwen3: `rope_parameters` spelled), the group, the usage."""
    config = {k: v for k, v in encoder.config.items() if not k.startswith("_")}
    config["architectures"] = [encoder.architecture.model_class]
    meta = {"quantization_config": json.dumps({"weight": {"group_size": group, "bits": 4, "zero_point": True,
                                                          "format": "tinychat"}}),
            "flux_port": json.dumps({"tool": "flux-port", "version": __version__, "method": "data-free min-max"})}
    if encoder.architecture.name == "qwen3":
        theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 1000000.0
        config["rope_parameters"] = {"rope_type": "default", **(config.get("rope_parameters") or {}),
                                     "rope_theta": theta}
        meta.update(text_encoder_usage="qwen3_text_only", model_type="qwen3_text",
                    runtime_class="NunchakuQwen3TextEncoderModel")
    meta["config"] = json.dumps(config, sort_keys=True)
    return meta


def quantize(w, group: int):
    """float weight [n, k] -> (codes [n, k] int32 0..15, scales [groups, n] bf16, scaled_zeros [groups, n] bf16),
    W ~ q * scales + scaled_zeros."""
    import torch

    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale, codes 0
    zero = lo.to(torch.bfloat16)  # scaled_zeros: W = q * s + lo
    s, z = scale.float().unsqueeze(2), zero.float().unsqueeze(2)
    codes = g.sub(z).div_(s).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
    rows = padded_groups(k, group)
    scales = torch.zeros(rows, n, dtype=torch.bfloat16)
    zeros = torch.zeros(rows, n, dtype=torch.bfloat16)
    scales[: k // group] = scale.t()
    zeros[: k // group] = zero.t()
    return codes, scales, zeros


@dataclass
class _Plan:
    entries: list[Entry]
    sources: list[tuple[str, str]]  # (source key, role): role "copy" or "qweight" (then scales, zeros follow)
    dropped: list[str]


def plan(encoder: TextEncoder, source: Source, group: int) -> _Plan:
    view, prefix = source.view, encoder.prefix
    quantized = set(encoder.linear_weights(view.tensors))
    entries, sources, dropped = [], [], []
    for key, info in view.tensors.items():
        if not key.startswith(prefix):
            dropped.append(key)  # lm_head: the loaders build the bare model
            continue
        name = key[len(prefix):]
        if key in quantized:
            n, k = info.shape
            if n % 4 or k % 64 or k % group:
                raise UsageError(f"--quantize awq-int4: {key!r} is [{n}, {k}]; the TinyChat layout needs rows in 4s "
                                 f"and inputs in multiples of 64 and of the group ({group}).")
            base = name[: -len("weight")]
            rows = padded_groups(k, group)
            entries += [Entry(base + "qweight", (n // 4, k), "I16"), Entry(base + "scales", (rows, n), "BF16"),
                        Entry(base + "scaled_zeros", (rows, n), "BF16")]
            sources.append((key, "qweight"))
        else:
            floating = info.computed or info.dtype in ("F32", "F16", "F64", "BF16")
            entries.append(Entry(name, tuple(info.shape), "BF16" if floating else info.dtype))
            sources.append((key, "copy"))
    return _Plan(entries, sources, dropped)


def _tensors(source: Source, p: _Plan, group: int, result: AwqResult) -> Iterator[Any]:
    import torch

    from porting.tensors.quant.svdq.tiles import pack_awq_codes

    view = source.view
    for key, role in p.sources:
        w = view.read(key)
        check_tensor(w, repr(key), source.path)
        if role == "copy":  # the rest in bf16, as the loaders run it
            yield (w.to(torch.bfloat16) if w.is_floating_point() else w).contiguous()
            continue
        codes, scales, zeros = quantize(w, group)
        back = codes.float().reshape(w.shape[0], -1, group) * scales[: w.shape[1] // group].t().float().unsqueeze(2)
        back = back.add_(zeros[: w.shape[1] // group].t().float().unsqueeze(2)).reshape(w.shape)
        rel = float((back - w.float()).norm() / max(float(w.float().norm()), 1e-30))
        if rel > result.worst_rel_l2:
            result.worst_rel_l2, result.worst_layer = rel, key
        yield pack_awq_codes(codes).view(torch.int16)
        yield scales
        yield zeros


def quantize_text_encoder(src: SourceLike, out: str | Path, group: int = GROUP, force: bool = False,
                          on_start: Callable[[int], None] | None = None,
                          on_bytes: Callable[[int], None] | None = None) -> AwqResult:
    """Write the text encoder `src` (a transformers folder or file) as one 4-bit file in `out`."""
    if group not in GROUP_SIZES:
        raise UsageError(f"group {group}: the TinyChat layout packs groups of {', '.join(map(str, GROUP_SIZES))}.")
    started = time.perf_counter()
    source = as_source(src, kind="text_encoder")
    encoder = source.text_encoder
    if encoder.quantized:
        raise UsageError(f"--quantize awq-int4: {source.path} is 4-bit already ({len(encoder.quantized)} layers).",
                         hint=f"port convert {source.path} --out DIR writes it as bf16 first.")
    p = plan(encoder, source, group)
    name = file_name(source.path)
    size = sum(e.nbytes for e in p.entries)
    bf16 = sum(math.prod(i.shape) * 2 for i in source.view.tensors.values())
    result = AwqResult(encoder, None, name, sum(1 for _, r in p.sources if r == "qweight"), len(p.entries), size,
                       bf16, dropped=p.dropped)
    out = Path(out)
    read_paths = {"source": source.path}
    check_output(out, force=force, verb="convert", inputs=read_paths)
    if on_start:
        on_start(size)
    with atomic_folder(out, force=force, verb="convert", inputs=read_paths) as staging:
        write_shards(staging, name.removesuffix(".safetensors"), p.entries, _tensors(source, p, group, result),
                     sys.maxsize, metadata=metadata(encoder, group), on_bytes=on_bytes)
        manifest = {"tool": "flux-port", "version": __version__, "format_version": 1, "kind": "text_encoder",
                    "source": str(source.path.resolve()), "to": "awq-int4", "file": name,
                    "architecture": encoder.architecture.model_class, "group_size": group,
                    "quantized_layers": result.layers, "dropped": p.dropped, "file_bytes": size, "bf16_bytes": bf16,
                    "worst_rel_l2": result.worst_rel_l2, "worst_layer": result.worst_layer}
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
        source.check_unchanged()
    result.out, result.seconds = out, time.perf_counter() - started
    return result


__all__ = ["AwqResult", "GROUP", "file_name", "metadata", "quantize", "quantize_text_encoder"]
