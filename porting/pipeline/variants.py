"""Which publish variant a pipeline folder is, from the family registry: its model_index.json `_class_name` and, where
one pipeline class serves several variants (FluxPipeline: FLUX.1 [dev] and [schnell]), the transformer's guidance
embedding. Generate, compare and bench ask this instead of naming pipeline classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from porting._files import read_config
from porting.errors import InputError
from porting.families import PipelineVariant, pipeline_variants


def matching_variants(index: Mapping[str, Any], transformer_cfg: Mapping[str, Any] | None = None) -> list[str]:
    """Variant names whose pipeline is the folder's class, those matching the transformer's guidance_embeds first
    (all of them when the config is unknown)."""
    variants = pipeline_variants()
    same_class = [name for name, (_, spec) in variants.items() if spec.pipeline == index.get("_class_name")]
    if transformer_cfg is None or "guidance_embeds" not in transformer_cfg:
        return same_class
    guided = bool(transformer_cfg.get("guidance_embeds"))
    return sorted(same_class, key=lambda name: variants[name][1].guidance_embeds != guided)


def folder_transformer_config(folder: Path | None) -> dict[str, Any] | None:
    """transformer/config.json of a pipeline folder, or None where there is none (or it cannot be read: the
    verbs refuse it by name later, where they load it)."""
    if folder is None or not (Path(folder) / "transformer" / "config.json").is_file():
        return None
    try:
        return read_config(Path(folder) / "transformer" / "config.json", "the transformer's config")
    except InputError:
        return None


def folder_variant(index: Mapping[str, Any], folder: Path | None = None) -> PipelineVariant | None:
    """The publish variant of a pipeline folder, or None for a pipeline class no family publishes."""
    names = matching_variants(index, folder_transformer_config(folder))
    return pipeline_variants()[names[0]][1] if names else None
