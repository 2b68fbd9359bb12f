"""`port publish`'s inputs: the base repository, the converted transformer and whether the two fit one pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from porting._files import read_json_object
from porting.engine.convert import MANIFEST as CONVERT_MANIFEST
from porting.errors import CheckFailed, InputError, PortError, UnsupportedFormatError
from porting.families import Family, PipelineVariant, pipeline_variants
from porting.inputs import open_source
from porting.paths import check_component_names


def variant_spec(variant: str) -> tuple[Family, PipelineVariant]:
    """The family and pipeline facts of a publishable variant (klein, klein-kv, dev, ...)."""
    known = pipeline_variants()
    if variant not in known:
        raise PortError(f"--variant {variant!r}: choose one of {', '.join(known)}.")
    return known[variant]


_read_json = read_json_object


def read_base(base: Path) -> dict[str, Any]:
    """The base repository's model_index.json, after checking its component folders exist."""
    if not base.is_dir():
        raise InputError(f"{base}: base folder not found.",
                         hint="Point --base at a diffusers-layout base repository (port fetch RECIPE downloads one).")
    index = _read_json(base / "model_index.json", "a diffusers base repository has one at its root")
    check_component_names(index, base / "model_index.json")
    for name in base_components(index):
        if not (base / name).is_dir():
            raise InputError(f"{base}: model_index.json lists component '{name}' but {base / name} is missing.",
                             hint="The base download is incomplete; run port fetch again.")
    return index


def base_components(index: dict[str, Any]) -> list[str]:
    """Components the base provides (everything in model_index.json but the transformer)."""
    return sorted(k for k, v in index.items() if not k.startswith("_") and k != "transformer"
                  and isinstance(v, list) and len(v) == 2 and v[0] is not None and v[1] is not None)


def infer_variant(base_index: dict[str, Any], transformer_cfg: dict[str, Any]) -> str:
    """The variant of the base's pipeline class; where one class serves several variants (FLUX.1 [dev] and
    [schnell] are both FluxPipeline), the one whose guidance embedding the transformer has."""
    from .variants import matching_variants

    same_class = matching_variants(base_index, transformer_cfg)
    if same_class:
        return same_class[0]
    for family, _ in pipeline_variants().values():
        if transformer_cfg.get("_class_name") == family.diffusers_class:
            return family.default_variant(transformer_cfg)
    raise InputError(f"the transformer's class {transformer_cfg.get('_class_name')!r} has no pipeline flux-port "
                     "publishes.", hint="Pass --variant, or publish a transformer of a family with pipelines.")


def transformer_identity(transformer: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(weights sha256 recomputed from the files, config.json, convert's flux-port.json or {})."""
    cfg = _read_json(transformer / "config.json", "a converted transformer folder has one; port convert writes it")
    weights = open_source(transformer, kind="weights").weights_sha256
    convert_manifest: dict[str, Any] = {}
    if (transformer / CONVERT_MANIFEST).is_file():
        convert_manifest = _read_json(transformer / CONVERT_MANIFEST, "written by port convert")
        recorded = convert_manifest.get("weights_sha256")
        if recorded and recorded != weights:
            raise CheckFailed(
                f"{transformer}: weights changed since port convert wrote them (recorded {recorded[:16]}..., "
                f"files now {weights[:16]}...).",
                hint="Convert again (port convert ... --force) and validate the new weights before publishing.")
    return weights, cfg, convert_manifest


def check_consistency(base: Path, base_index: dict[str, Any], cfg: dict[str, Any], variant: str) -> list[str]:
    """Refuse a transformer that does not fit the base; returns notices for checks that could not run."""
    family, spec = variant_spec(variant)
    notices: list[str] = []
    problems: list[str] = []
    if cfg.get("_class_name") != family.diffusers_class:
        problems.append(f"transformer/config.json _class_name is {cfg.get('_class_name')!r}, the {spec.title} "
                        f"pipeline needs {family.diffusers_class!r}")
    if bool(cfg.get("guidance_embeds")) != spec.guidance_embeds:
        problems.append(f"transformer guidance_embeds is {bool(cfg.get('guidance_embeds'))}, {spec.title} has "
                        f"{spec.guidance_embeds}")
    base_cfg_path = base / "transformer" / "config.json"
    if base_cfg_path.is_file():
        for name, want, got in family.config_mismatches(_read_json(base_cfg_path, "base transformer config"), cfg):
            problems.append(f"{name}: base {base_cfg_path} has {want}, the fine-tune has {got}")
    else:
        notices.append(f"{base_cfg_path} not found: the fine-tune's architecture was only checked against the "
                       "other components")
    for component, wanted in spec.text_encoders.items():
        entry = base_index.get(component)
        found = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if found != wanted:
            problems.append(f"base model_index.json {component} is {found!r}, {spec.pipeline} needs {wanted!r}")
    problems += family.pipeline_fit(base, cfg, spec)
    if problems:
        raise CheckFailed(
            f"the transformer does not fit the base {base} ({len(problems)} problem(s)); nothing was written.",
            details="\n".join(f"  {p}" for p in problems),
            hint="A fine-tune must be published with the base it was trained from (the same model and size), "
                 f"and --variant must match it (the base and transformer say {variant}).")
    return notices


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def refuse_pickles(files: list[Path]) -> None:
    """A base holding pickle weights is refused the way convert refuses a pickle checkpoint: loading one can run
    arbitrary code, and a published folder would pass it on."""
    pickles = [f for f in files if f.suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        shown = ", ".join(str(p) for p in pickles[:3]) + (f" and {len(pickles) - 3} more" if len(pickles) > 3 else "")
        raise UnsupportedFormatError(
            f"the base holds pickle weights ({shown}); they can run arbitrary code when loaded, so flux-port "
            "refuses to publish them.",
            hint="Use a base with .safetensors weights (the official repositories have them), or convert the "
                 "component to safetensors in a sandbox you trust.")

