"""Text-encoder checkpoints as their own kind of input: a file of transformers' state-dict names (a bare Qwen3Model,
a T5EncoderModel), the config in its metadata, as Nunchaku ships its 4-bit text encoders.

What each architecture is, is data (`ARCHITECTURES`): the keys that mark it, its transformers classes, the metadata
key its config is in, and who loads the file as stored. Recognition reads the header only.
Facts: shared/nunchaku-dialects.md section 1.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from porting.errors import InputError
from porting.tensors.checkpoint import Checkpoint
from porting.tensors.quant import awq_w4a16


@dataclass(frozen=True)
class Architecture:
    name: str
    label: str
    model_class: str  # transformers class whose state-dict names the file uses
    config_class: str
    markers: tuple[str, ...]  # keys present in every such file
    layer_key: str  # a regex whose group 1 is a layer's index
    config_fields: Mapping[str, str]  # config field -> a key whose shape gives it, "key:dim"
    pipelines: str
    runtimes: tuple[str, ...]  # who loads the file as it is stored (4-bit)
    linears: tuple[str, ...]  # the module names (last part) of the linears a 4-bit file quantizes
    slot: str  # the pipeline component it is (model_index.json's name)
    prefixed: Mapping[str, str] = field(default_factory=dict)  # key prefix -> the class that saves with it


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "qwen3", "Qwen3 text encoder (FLUX.2 [klein]'s; transformers Qwen3Model)", "Qwen3Model", "Qwen3Config",
        ("embed_tokens.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"), r"layers\.(\d+)\.",
        {"hidden_size": "embed_tokens.weight:1", "vocab_size": "embed_tokens.weight:0",
         "head_dim": "layers.0.self_attn.q_norm.weight:0", "intermediate_size": "layers.0.mlp.gate_proj.weight:0"},
        "Flux2KleinPipeline (text_encoder)",
        ("tonera's Nunchaku Qwen3 encoder (NunchakuQwenEncoderModel.from_pretrained; CUDA)",
         "ComfyUI-nunchaku (the Qwen3 encoder node, pending upstream)"),
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "text_encoder",
        {"model.": "Qwen3ForCausalLM"}),
    Architecture(
        "t5", "T5 encoder (FLUX.1's T5-XXL; transformers T5EncoderModel)", "T5EncoderModel", "T5Config",
        ("shared.weight", "encoder.final_layer_norm.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"),
        r"encoder\.block\.(\d+)\.",
        {"d_model": "shared.weight:1", "vocab_size": "shared.weight:0",
         "d_ff": "encoder.block.0.layer.1.DenseReluDense.wo.weight:1"},
        "FluxPipeline (text_encoder_2)",
        ("nunchaku's NunchakuT5EncoderModel.from_pretrained (FLUX.1; CUDA, group 128)",),
        ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"), "text_encoder_2"),
)
LAYER_COUNT = {"qwen3": "num_hidden_layers", "t5": "num_layers"}
HINT = ("A 4-bit text encoder carries its transformers config in the header metadata ('config'), as Nunchaku's "
        "loaders require; use the file as published, or convert the original bf16 text encoder folder.")


@dataclass(frozen=True)
class TextEncoder:
    """A recognised text-encoder checkpoint: which architecture, its config (checked against the tensors), which
    layers are 4-bit."""

    architecture: Architecture
    config: dict[str, Any]
    layers: int
    quantized: tuple[str, ...] = field(default=())  # the 4-bit linears (module names)
    group: int | None = None  # their group size
    prefix: str = ""  # "model.": saved by Qwen3ForCausalLM (a pipeline's text_encoder folder)

    @property
    def model_class(self) -> str:
        return self.architecture.prefixed.get(self.prefix, self.architecture.model_class)

    def linear_weights(self, keys: Iterable[str]) -> list[str]:
        """The keys of `keys` that are weights of the linears a 4-bit file quantizes."""
        names = set(self.architecture.linears)
        return [k for k in keys if k.endswith(".weight") and k.rsplit(".", 2)[-2] in names]


def recognise(view: Checkpoint) -> tuple[Architecture, str] | None:
    """The architecture whose marker keys the (decoded) checkpoint holds, and the prefix they carry; or None."""
    keys = set(view.tensors)
    for arch in ARCHITECTURES:
        for prefix in ("", *arch.prefixed):
            if {prefix + m for m in arch.markers} <= keys:
                return arch, prefix
    return None


def _config(view: Checkpoint, arch: Architecture) -> dict[str, Any]:
    if view.config is not None:  # a transformers folder's config.json
        return dict(view.config)
    meta = view.metadata or {}
    raw = meta.get("config") or meta.get("base_text_config")
    if raw is None:
        raise InputError(f"{view.path}: a {arch.label} with no 'config' in its metadata: the architecture's sizes "
                         "(heads, rotary base, norms) are not in the tensors.", hint=HINT)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise InputError(f"{view.path}: metadata 'config' is not JSON.", hint=HINT) from None
    if isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        doc = doc["text_config"]
    if not isinstance(doc, dict):
        raise InputError(f"{view.path}: metadata 'config' is not a JSON object.", hint=HINT)
    return doc


def open_text_encoder(view: Checkpoint) -> TextEncoder:
    """The text encoder `view` holds, its metadata config checked against the tensors' shapes and layer count."""
    found = recognise(view)
    if found is None:
        raise InputError(f"{view.path}: not a text encoder flux-port knows (Qwen3Model or T5EncoderModel names).")
    arch, prefix = found
    config = _config(view, arch)
    for name, where in arch.config_fields.items():
        key, _, dim = where.partition(":")
        info = view.tensors.get(prefix + key)
        if info is None or name not in config:
            continue
        if config[name] != info.shape[int(dim)]:
            raise InputError(f"{view.path}: metadata config gives {name} = {config[name]!r}, but {key!r} is "
                             f"{list(info.shape)} ({name} {info.shape[int(dim)]}): the metadata contradicts the "
                             "tensors.", hint=HINT)
    indices = {int(m.group(1)) for k in view.tensors if (m := re.match(re.escape(prefix) + arch.layer_key, k))}
    count = config.get(LAYER_COUNT[arch.name])
    if isinstance(count, int) and (not indices or max(indices) >= count or len(indices) != count):
        missing = sorted(set(range(count)) - indices)
        raise InputError(f"{view.path}: metadata config gives {LAYER_COUNT[arch.name]} = {count}, the file holds "
                         f"{len(indices)} layer(s)" + (f" (layer {missing[0]} missing)" if missing else "") + ": the "
                         "loaders build every layer of the config and refuse missing keys.", hint=HINT)
    stored = view.stored_tensors
    quantized = tuple(sorted(k[: -len(".qweight")] for k in stored if k.endswith(".qweight")))
    group = awq_w4a16.group_size(view.metadata, str(view.path))[0] if quantized else None
    return TextEncoder(arch, config, len(indices), quantized, group, prefix)


def looks_like_text_encoder(view: Checkpoint) -> bool:
    return recognise(view) is not None


__all__ = ["ARCHITECTURES", "Architecture", "TextEncoder", "recognise", "open_text_encoder",
           "looks_like_text_encoder"]
