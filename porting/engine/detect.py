"""Recognise a checkpoint from its header alone: naming, prefix, family, variant and the full diffusers config."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from porting.errors import ConfigMismatchError, InputError, UnknownArchitectureError
from porting.tensors.checkpoint import Checkpoint

from .mapping import NAMINGS, MappingTable, Naming, builtin_tables

# Prefixes added by training and UI tools (ComfyUI saves `model.diffusion_model.`).
KNOWN_PREFIXES = ("", "model.diffusion_model.", "diffusion_model.", "model.", "net.")

# Fields that define the architecture: a fine-tune must agree with its base on all of them.
STRUCTURAL_FIELDS = ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                     "joint_attention_dim", "in_channels", "guidance_embeds", "mlp_ratio",
                     "pooled_projection_dim", "timestep_guidance_channels")


@dataclass
class Detection:
    table: MappingTable
    naming: Naming
    prefix: str
    config: dict[str, Any]  # diffusers config for table.diffusers_class
    variant: str
    inferred: dict[str, Any] = field(default_factory=dict)  # raw facts read from shapes

    @property
    def naming_label(self) -> str:
        return f"{self.naming} (prefix {self.prefix!r})" if self.prefix else self.naming


def _find_naming(keys: set[str], tables: Mapping[str, MappingTable]) -> tuple[MappingTable, Naming, str] | None:
    for table in tables.values():
        for naming in NAMINGS:
            for prefix in KNOWN_PREFIXES:
                if all(prefix + m in keys for m in table.detect[naming]):
                    return table, naming, prefix
    return None


def _unknown_architecture(ckpt: Checkpoint, tables: Mapping[str, MappingTable]) -> UnknownArchitectureError:
    keys = sorted(ckpt.tensors)
    markers = [(t.name, n, m) for t in tables.values() for n in NAMINGS for m in t.detect[n]]
    lines = []
    for name, naming, marker in markers:
        close = difflib.get_close_matches(marker, keys, n=1, cutoff=0.6)
        lines.append(f"  {name} {naming}: needs {marker!r}" + (f" (closest here: {close[0]!r})" if close else ""))
    sample = ", ".join(repr(k) for k in keys[:8])
    return UnknownArchitectureError(
        f"{ckpt.path}: keys match no known architecture ({len(keys)} tensors, e.g. {sample}).",
        hint="flux-port knows FLUX.2 (klein, dev) and FLUX.1 (dev, schnell) transformers in original or diffusers "
             "naming. Is this a LoRA, a VAE, a text encoder or a full pipeline file?",
        details="Markers not found:\n" + "\n".join(lines))


def _block_count(ckpt_keys: list[str], table: MappingTable, naming: Naming, placeholder: str) -> int:
    pattern = table.block_patterns(naming)[placeholder]
    indices = {int(m.group(1)) for k in ckpt_keys if (m := pattern.match(k))}
    return max(indices) + 1 if indices else 0


def _derive_config(table: MappingTable, facts: Mapping[str, Any]) -> dict[str, Any]:
    """Diffusers config from the facts read off shapes. Per-family constants live here, sizes come from shapes."""
    head_dim = int(facts["attention_head_dim"])
    inner = int(facts["inner_dim"])
    in_channels = int(facts["in_channels"])
    out_features = int(facts["out_features"])
    config: dict[str, Any] = {
        "_class_name": table.diffusers_class,
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": None if out_features == in_channels else out_features,
        "num_layers": int(facts["num_layers"]),
        "num_single_layers": int(facts["num_single_layers"]),
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": int(facts["joint_attention_dim"]),
        "guidance_embeds": bool(facts.get("guidance_embeds", False)),
    }
    if table.name == "flux2":
        config.update({
            "timestep_guidance_channels": int(facts["timestep_guidance_channels"]),
            "mlp_ratio": facts["mlp_hidden"] / inner,
            "axes_dims_rope": [head_dim // 4] * 4,
            "rope_theta": 2000,
            "eps": 1e-6,
        })
    elif table.name == "flux1":
        config["pooled_projection_dim"] = int(facts["pooled_projection_dim"])
        # released FLUX.1 uses 3-axis RoPE (16, 56, 56) for head_dim 128; other head dims keep the same proportions
        first = head_dim // 8
        rest = (head_dim - first) // 2
        config["axes_dims_rope"] = [16, 56, 56] if head_dim == 128 else [first, rest, head_dim - first - rest]
    return config


def infer_facts(ckpt: Checkpoint, table: MappingTable, naming: Naming, prefix: str) -> dict[str, Any]:
    keys = [k[len(prefix):] for k in ckpt.tensors if k.startswith(prefix)]
    facts: dict[str, Any] = {}
    for name, (key, dim) in table.infer[naming].items():
        info = ckpt.tensors.get(prefix + key)
        if info is None or dim >= len(info.shape):
            raise InputError(f"{ckpt.path}: cannot infer {name}: tensor {key!r} is missing or has the wrong rank "
                             f"({list(info.shape) if info else 'absent'}).",
                             hint="Pass the base model's config with --config.")
        facts[name] = info.shape[dim]
    for flag, keys_by_naming in table.present.items():
        facts[flag] = (prefix + keys_by_naming[NAMINGS.index(naming)]) in ckpt.tensors
    for placeholder, config_field in table.blocks.items():
        facts[config_field] = _block_count(keys, table, naming, placeholder)
    return facts


def match_variant(table: MappingTable, config: Mapping[str, Any]) -> str:
    for variant in table.variants:
        if all(config.get(k) == v for k, v in variant["match"].items()):
            return variant["name"]
    return f"custom {table.name}"


def load_base_config(path: str | Path) -> dict[str, Any]:
    """A base model folder (its transformer/config.json), a model folder, or a config.json file."""
    path = Path(path)
    for candidate in (path / "transformer" / "config.json", path / "config.json", path):
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text())
            except ValueError as e:
                raise InputError(f"{candidate}: not valid JSON ({e}).") from e
    raise InputError(f"{path}: no transformer/config.json or config.json found.",
                     hint="Point --config at a diffusers base model folder or its transformer/config.json.")


def config_mismatches(base: Mapping[str, Any], inferred: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    out = []
    for name in STRUCTURAL_FIELDS:
        if name in base and name in inferred and base[name] != inferred[name]:
            out.append((name, base[name], inferred[name]))
    return out


def detect(ckpt: Checkpoint, base_config: Mapping[str, Any] | None = None,
           tables: Mapping[str, MappingTable] | None = None) -> Detection:
    """Identify the checkpoint and build its diffusers config from shapes (no tensor data is read)."""
    tables = tables or builtin_tables()
    found = _find_naming(set(ckpt.tensors), tables)
    if found is None:
        raise _unknown_architecture(ckpt, tables)
    table, naming, prefix = found
    facts = infer_facts(ckpt, table, naming, prefix)
    config = _derive_config(table, facts)
    if ckpt.config and naming == "diffusers" and ckpt.config.get("_class_name") == table.diffusers_class:
        base_config = base_config or ckpt.config  # a diffusers folder brings its own config
    if base_config is not None:
        base_class = base_config.get("_class_name")
        if base_class and base_class != table.diffusers_class:
            raise ConfigMismatchError(f"The base config is for {base_class}, the checkpoint is a "
                                      f"{table.diffusers_class} ({table.name}).")
        bad = config_mismatches(base_config, config)
        if bad:
            rows = "\n".join(f"  {n}: base {b!r}, checkpoint {c!r}" for n, b, c in bad)
            raise ConfigMismatchError(
                f"{ckpt.path}: this checkpoint does not fit the base config ({len(bad)} field(s) differ).",
                hint="Check that the fine-tune was trained from this base (klein-4B vs klein-9B?).",
                details=rows, report={"config_mismatch": [dict(field=n, base=b, checkpoint=c) for n, b, c in bad]})
        merged = {k: v for k, v in base_config.items() if not k.startswith("_")}
        config = {"_class_name": table.diffusers_class, **merged}
    return Detection(table, naming, prefix, config, match_variant(table, config), facts)
