"""Which runtime loads a checkpoint as it is, which after one `port convert`, which not at all; and whether the
companions in a base folder fit the transformer.

Each runtime is one small function of the checkpoint's facts (naming, prefix, spelling, files, quantized layout),
written from what the runtimes' own loaders accept (their loading code; docs/convert.md and docs/quantized.md
say what each takes): a new runtime is a new function in `RUNTIMES`, not a branch elsewhere.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

AS_IS, AFTER, NEVER, UNKNOWN = "loads as is", "after port convert", "not at all", "unknown"
# a verdict is UNKNOWN where the loader's code read does not settle it (docs/adapters.md, "Which runtime loads it")
BFL_FLUX2_READ = "black-forest-labs/flux2 at ab7cca6"
COMFY_LAYOUTS = ("ComfyUI",)  # quantized layouts ComfyUI core reads: its own scaled fp8 and comfy_quant files


@dataclass(frozen=True)
class Facts:
    """What a runtime's loader looks at, read from headers."""

    path: Path
    family: str  # the family's name (flux1, flux2, ...)
    naming: str  # original / diffusers
    prefix: str
    respelled: int  # keys in another tool's spelling (ComfyUI-saved `.weight` norms)
    files: int
    has_config: bool  # a diffusers model folder with config.json
    container: str  # safetensors / gguf
    quantized: str | None  # the quantized layout's label
    title: str = ""  # the family as users name it (FLUX.2)
    single_file_strips_prefix: bool = True  # the family's declaration (`Family.single_file_strips_prefix`)
    variant: str = ""  # the mapping table's variant name (klein-4B, FLUX.2-dev, FLUX.1-dev, ...; custom)
    svdq: Mapping[str, Any] | None = None  # an SVDQuant model's header facts (layout, spelling, precision, ...)
    comfy_config: bool = False  # header metadata `comfy_config` (ComfyUI-nunchaku's FLUX.1 loader needs it)


@dataclass(frozen=True)
class Verdict:
    runtime: str
    status: str
    detail: str
    command: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "status": self.status, "detail": self.detail, "command": self.command}


def _original_file(f: Facts) -> str:
    return f"port convert {shlex.quote(str(f.path))} --to original --out {shlex.quote(_out_name(f, 'original'))}"


def _diffusers_folder(f: Facts) -> str:
    return f"port convert {shlex.quote(str(f.path))} --out {shlex.quote(_out_name(f, 'transformer'))}"


def _gguf(f: Facts) -> str:
    return (f"port convert {shlex.quote(str(f.path))} --to original --quantize gguf-q8_0 "
            f"--out {shlex.quote(_out_name(f, 'gguf'))}")


def _out_name(f: Facts, what: str) -> str:
    stem = f.path.stem if f.path.is_file() else f.path.name
    return f"{stem}-{what}"


def diffusers_from_pretrained(f: Facts) -> Verdict:
    name = "diffusers from_pretrained"
    if f.svdq is not None and f.svdq.get("layout") == "diffusers":
        return Verdict(name, AFTER, "diffusers' Nunchaku layout: from_pretrained loads it only on a CUDA GPU with "
                       "the Hub's kernels (the diffusers Nunchaku Lite row); convert writes the bf16 folder any device "
                       "loads", _diffusers_folder(f))
    if f.naming == "diffusers" and f.has_config and f.quantized is None:
        return Verdict(name, AS_IS, "a diffusers model folder with its config.json")
    why = {True: f"{f.quantized} weights", False: "original (BFL) naming" if f.naming == "original"
           else "no config.json beside the weights"}[f.quantized is not None]
    return Verdict(name, AFTER, f"{why}; convert writes a diffusers folder", _diffusers_folder(f))


def diffusers_from_single_file(f: Facts) -> Verdict:
    name = "diffusers from_single_file"
    if f.files > 1:
        return Verdict(name, AFTER, "one file only; this checkpoint is sharded", _original_file(f))
    if f.container == "gguf":
        return Verdict(name, AS_IS, "with GGUFQuantizationConfig and config= a local pipeline folder")
    if f.quantized is not None and not f.quantized.startswith("BFL"):
        return Verdict(name, AFTER, f"{f.quantized}: its scales are not consumed by diffusers' converter",
                       _original_file(f))
    if f.prefix and not f.single_file_strips_prefix:
        return Verdict(name, AFTER, f"the {f.title or f.family} converter does not strip the {f.prefix!r} prefix "
                       "(KeyError)", _original_file(f))
    if f.respelled:
        return Verdict(name, AFTER, "ComfyUI-saved `.weight` norm scales are not in diffusers' converter",
                       _original_file(f))
    return Verdict(name, AS_IS, "pass config= a local pipeline folder (klein is otherwise detected as dev)")


def comfyui_core(f: Facts) -> Verdict:
    name = "ComfyUI (core)"
    if f.container == "gguf":
        return Verdict(name, AFTER, "GGUF needs the ComfyUI-GGUF node; core loads safetensors",
                       _original_file(f))
    if f.naming != "original":
        if f.family == "flux2":  # comfy/model_detection.py convert_diffusers_mmdit reads x_embedder.bias
            return Verdict(name, AFTER, "ComfyUI's diffusers-naming path reads `x_embedder.bias`, which FLUX.2 has "
                           "not (KeyError)", _original_file(f))
        if f.family != "flux1":
            return Verdict(name, UNKNOWN, f"ComfyUI's diffusers-naming path was not read for {f.title or f.family}")
        if f.prefix:
            return Verdict(name, UNKNOWN, f"ComfyUI converts FLUX.1 diffusers keys without a prefix; {f.prefix!r} "
                           "was not traced through its loader")
    if f.files > 1:
        return Verdict(name, AFTER, "no sharded loader: given shard 1 it detects a smaller model without an error",
                       _original_file(f))
    if f.quantized is not None and not f.quantized.startswith(COMFY_LAYOUTS):
        return Verdict(name, AFTER, f"{f.quantized} is not a ComfyUI layout; convert writes bf16 (or add "
                       "--quantize fp8-scaled)", _original_file(f))
    if f.naming != "original":
        return Verdict(name, AS_IS, "diffusers naming, one file: ComfyUI converts FLUX.1 diffusers keys as it loads "
                       "(convert_diffusers_mmdit)")
    return Verdict(name, AS_IS, "original naming, one file" + (f", prefix {f.prefix!r}" if f.prefix else ""))


def comfyui_gguf(f: Facts) -> Verdict:
    name = "ComfyUI-GGUF"
    if f.container == "gguf":
        return Verdict(name, AS_IS, "Unet Loader (GGUF); dequant_dtype float32 for exact values")
    return Verdict(name, AFTER, "it loads .gguf files", _gguf(f))


def bfl_reference(f: Facts) -> Verdict:
    name = "BFL reference code"
    ok = (f.naming == "original" and not f.prefix and not f.respelled and f.files == 1 and f.quantized is None
          and f.container == "safetensors")
    if ok:
        return _bfl_model(f)
    why = ("diffusers naming" if f.naming != "original" else f"prefix {f.prefix!r}" if f.prefix
           else "ComfyUI-saved `.weight` norm scales" if f.respelled else "sharded" if f.files > 1
           else f"{f.quantized or f.container} weights")
    return Verdict(name, AFTER, f"{why}; it loads one plain original-naming file", _original_file(f))


def _bfl_model(f: Facts) -> Verdict:
    """A plain original-naming file: BFL's loaders build fixed geometries by model name, so the variant decides."""
    name = "BFL reference code"
    if f.family == "flux1" and f.variant in ("FLUX.1-dev", "FLUX.1-schnell"):
        return Verdict(name, AS_IS, "original naming, one file, no prefix (black-forest-labs/flux)")
    if f.family == "flux2" and f.variant == "FLUX.2-dev":
        return Verdict(name, AS_IS, f"original naming, one file, no prefix ({BFL_FLUX2_READ}: flux.2-dev)")
    if f.family == "flux2" and f.variant.startswith("klein"):
        return Verdict(name, UNKNOWN, f"{BFL_FLUX2_READ}, the code read, defines FLUX.2 [dev] only; later "
                       "revisions name klein weights in their README, their loader was not read")
    return Verdict(name, UNKNOWN, f"BFL's loaders build the released geometries by name; {f.variant or 'this'} "
                   "geometry was not traced through them")


RUNTIMES: tuple[Callable[[Facts], Verdict], ...] = (
    diffusers_from_pretrained, diffusers_from_single_file, comfyui_core, comfyui_gguf, bfl_reference)


# --- the 4-bit SVDQuant runtimes (asked of SVDQuant models only) ---------------------------------------------------
# Nunchaku's own layout (one file, header metadata `config` / `quantization_config`) and diffusers' own (a folder,
# `quantization_config.quant_method` "nunchaku_lite" in config.json); svdquant.md sections 1 and 5,
# nunchaku-dialects.md section 2.

def _relayout(f: Facts, layout: str) -> str:
    return (f"port convert {shlex.quote(str(f.path))} --layout {layout} "
            f"--out {shlex.quote(_out_name(f, layout))}")


def _svdq_quantize(f: Facts, layout: str = "nunchaku") -> str:
    extra = " --layout diffusers" if layout == "diffusers" else ""
    return (f"port convert {shlex.quote(str(f.path))} --quantize svdq-int4{extra} "
            f"--out {shlex.quote(_out_name(f, 'svdq'))}")


def _rewritten(f: Facts) -> str:
    """Nunchaku's file written anew by flux-port (module names, comfy_config, one file): a round trip through
    diffusers' layout, exact for its layers."""
    return (f"{_relayout(f, 'diffusers')} && port convert {shlex.quote(_out_name(f, 'diffusers'))} --layout nunchaku "
            f"--out {shlex.quote(_out_name(f, 'nunchaku'))}")


def _svdq_layout(f: Facts) -> str | None:
    return None if f.svdq is None else f.svdq.get("layout")


def nunchaku_flux1(f: Facts) -> Verdict:
    name = "Nunchaku FLUX.1 (v1 / v2 loaders)"
    if f.family != "flux1":
        return Verdict(name, NEVER, f"NunchakuFluxTransformer2dModel builds FLUX.1 only; this is {f.title or f.family}")
    if _svdq_layout(f) == "diffusers":
        return Verdict(name, AFTER, "diffusers' Nunchaku layout (unfused modules, config.json targets); Nunchaku "
                       "loads its own single file", _relayout(f, "nunchaku"))
    if _svdq_layout(f) is None:
        return Verdict(name, AFTER, "it loads 4-bit SVDQuant files", _svdq_quantize(f))
    if f.files > 1:
        return Verdict(name, UNKNOWN, "the older split folder: v1's legacy loader reads it; v2's was not read for it")
    return Verdict(name, AS_IS, "one file in deepcompressor's names: v2's from_pretrained renames them "
                   "(convert_flux_state_dict), v1 loads them as they are")


def tonera_flux2(f: Facts) -> Verdict:
    name = "Nunchaku FLUX.2 (tonera's runtime)"
    if f.family != "flux2":
        return Verdict(name, NEVER, "NunchakuFlux2Transformer2DModel builds FLUX.2 only; this is "
                       f"{f.title or f.family}")
    layout = _svdq_layout(f)
    if layout == "diffusers":
        return Verdict(name, AFTER, "diffusers' Nunchaku layout; tonera's loader takes Nunchaku's single file",
                       _relayout(f, "nunchaku"))
    if layout is None:
        return Verdict(name, AFTER, "it loads 4-bit SVDQuant files", _svdq_quantize(f))
    if (f.svdq or {}).get("spelling") != "module":
        return Verdict(name, AFTER, "deepcompressor-style layer names: its strict loader takes the module names "
                       "(attn.to_qkv.proj_down, ...); a round trip through diffusers' layout writes them",
                       _rewritten(f))
    return Verdict(name, AS_IS, "one file in the runtime's module names (its loader is strict)")


def comfyui_nunchaku(f: Facts) -> Verdict:
    name = "ComfyUI-nunchaku"
    layout = _svdq_layout(f)
    if f.family not in ("flux1", "flux2"):
        return Verdict(name, UNKNOWN, f"its DiT loaders were read for FLUX.1 and FLUX.2, not {f.title or f.family}")
    if layout == "diffusers":
        return Verdict(name, AFTER, "diffusers' Nunchaku layout; its DiT loaders read Nunchaku's single file",
                       _relayout(f, "nunchaku"))
    if layout is None:
        return Verdict(name, AFTER, "it loads 4-bit SVDQuant files", _svdq_quantize(f))
    if f.files > 1:
        return Verdict(name, AFTER, "its loaders read one file", _rewritten(f))
    if f.family == "flux1" and not f.comfy_config:
        return Verdict(name, AFTER, "NunchakuFluxDiTLoader needs header metadata comfy_config, which this file has "
                       "not; flux-port writes it", _rewritten(f))
    how = "comfy_config" if f.family == "flux1" else "comfy_config, or its config when that is absent"
    return Verdict(name, AS_IS, f"one file; the DiT loader builds its model from {how}")


def diffusers_nunchaku_lite(f: Facts) -> Verdict:
    name = "diffusers Nunchaku Lite"
    layout = _svdq_layout(f)
    if layout == "diffusers":
        return Verdict(name, AS_IS, "from_pretrained on a CUDA GPU (not Hopper; nvfp4 needs Blackwell), its kernels "
                       "fetched from the Hub (DIFFUSERS_TRUST_REMOTE_KERNELS=1)")
    if layout is None:
        return Verdict(name, AFTER, "it loads diffusers folders quantized in its own Nunchaku layout",
                       _svdq_quantize(f, "diffusers"))
    return Verdict(name, AFTER, "Nunchaku's own layout (fused / split layers, no targets in a config.json); "
                   "moved into diffusers' layout without requantizing", _relayout(f, "diffusers"))


SVDQ_RUNTIMES: tuple[Callable[[Facts], Verdict], ...] = (
    nunchaku_flux1, tonera_flux2, comfyui_nunchaku, diffusers_nunchaku_lite)


def facts_of(path: Path, ckpt: Any, detection: Any) -> Facts:
    return Facts(path=Path(path), family=detection.table.name, naming=detection.naming, prefix=detection.prefix,
                 respelled=len(detection.respelled), files=len(ckpt.files),
                 has_config=ckpt.config is not None, container=ckpt.container,
                 quantized=ckpt.quantization.label if ckpt.quantization else None,
                 title=detection.family.title, single_file_strips_prefix=detection.family.single_file_strips_prefix,
                 variant=detection.variant, svdq=_svdq_details(ckpt),
                 comfy_config="comfy_config" in (ckpt.metadata or {}))


def _svdq_details(ckpt: Any) -> Mapping[str, Any] | None:
    details = ckpt.quantization.details if ckpt.quantization else None
    return details if details and details.get("layout") in ("nunchaku", "diffusers") else None


def runtimes(facts: Facts) -> list[Verdict]:
    """Every runtime's verdict; the 4-bit SVDQuant runtimes for SVDQuant models only."""
    return [judge(facts) for judge in RUNTIMES + (SVDQ_RUNTIMES if facts.svdq is not None else ())]


# --- companions in a base folder ---------------------------------------------------------------------------------

def companions(base: Path, config: Mapping[str, Any], family: Any) -> list[dict[str, Any]]:
    """Checks of the base's text encoder, VAE and pipeline class against the transformer's config: each a row
    {check, ok, detail}."""
    from porting._files import read_config

    def read(rel: str) -> dict[str, Any] | None:
        p = base / rel
        return read_config(p, "a JSON object") if p.is_file() else None

    rows: list[dict[str, Any]] = []
    te = read("text_encoder/config.json")
    if te is not None and te.get("hidden_size"):
        width = 3 * int(te["hidden_size"])  # the pipeline stacks three hidden layers of the text encoder
        want = config.get("joint_attention_dim")
        rows.append({"check": "text encoder width", "ok": width == want,
                     "detail": f"text encoder hidden {te['hidden_size']} x 3 layers = {width}; the transformer's "
                               f"joint_attention_dim is {want}" + ("" if width == want else
                               " (a text encoder of another model size: 'expected ... got ...' at the first step)")})
    vae = read("vae/config.json")
    if vae is not None and vae.get("latent_channels"):
        packed = 4 * int(vae["latent_channels"])  # 2x2 patches
        want = config.get("in_channels")
        rows.append({"check": "VAE latent channels", "ok": packed == want,
                     "detail": f"VAE latent_channels {vae['latent_channels']} x 2x2 = {packed}; the transformer's "
                               f"in_channels is {want}"})
    index = read("model_index.json")
    if index is not None and family.pipelines:
        rows.append(_variant_row(index, config, family.pipelines))
    base_cfg = read("transformer/config.json")
    if base_cfg is not None:
        bad = family.config_mismatches(base_cfg, config)
        rows.append({"check": "transformer config", "ok": not bad,
                     "detail": "the base's transformer/config.json fits" if not bad else
                     "; ".join(f"{n}: base {b!r}, this file {c!r}" for n, b, c in bad)})
    return rows


def _variant_row(index: Mapping[str, Any], config: Mapping[str, Any], variants: Mapping[str, Any]) -> dict[str, Any]:
    """The base's pipeline class (a variant the family publishes) against the transformer's guidance embedder."""
    cls = str(index.get("_class_name", ""))
    by_class = {v.pipeline: (name, v) for name, v in variants.items()}
    name, variant = by_class.get(cls, (cls, None))
    if variant is not None and variant.registers_is_distilled and not index.get("is_distilled", False):
        name = f"{name} base (undistilled)"
    wants_guidance = bool(config.get("guidance_embeds"))
    ok = (variant is not None and variant.guidance_embeds) == wants_guidance
    like = next((n for n, v in variants.items() if v.guidance_embeds == wants_guidance), None)
    kind = (f"{like}-like " if like else "") + ("(guidance embedder)" if wants_guidance else "(no guidance embedder)")
    return {"check": "variant", "ok": ok, "detail": f"base is {name} ({cls}); the transformer is {kind}"}


# --- adapters ----------------------------------------------------------------------------------------------------

# comfy/lora.py model_lora_keys_unet: the diffusers-naming key prefixes it maps onto a FLUX model
COMFY_DIFFUSERS_PREFIXES = ("transformer.", "lycoris_", "lora_transformer_")
# FLUX.2 modules whose diffusers LoRA keys ComfyUI was seen both dropping (v0.18.x, shared/targets-and-scale.md
# section 1) and loading (a later run); its key map for them was not read
FLUX2_UNSETTLED = ("double_stream_modulation", "single_stream_modulation", "time_guidance_embed")


def _comfy_adapter(info: Mapping[str, Any], to_original: str) -> Verdict:
    name = "ComfyUI (core)"
    if info["naming"] == "original":
        return Verdict(name, AS_IS, f"{info['format']} in original naming")
    if info["family"] not in ("flux1", "flux2"):
        return Verdict(name, UNKNOWN, f"ComfyUI's diffusers LoRA keys were not read for {info['family']}")
    if info["prefix"] not in COMFY_DIFFUSERS_PREFIXES:
        return Verdict(name, AFTER, "ComfyUI maps FLUX diffusers LoRA keys under "
                       f"{', '.join(COMFY_DIFFUSERS_PREFIXES)} only; {info['prefix'] or 'unprefixed'} keys are not "
                       "loaded", to_original)
    unsettled = [t for t in info["targets"] if t.startswith(FLUX2_UNSETTLED)] if info["family"] == "flux2" else []
    if unsettled:
        return Verdict(name, UNKNOWN, f"{len(unsettled)} module(s) ({', '.join(unsettled[:3])}) of FLUX.2's global "
                       "modulation or time embedding: whether ComfyUI maps their diffusers keys was not read from "
                       "its code (port convert --to original is certain)")
    return Verdict(name, AS_IS, f"diffusers naming, prefix {info['prefix']}: ComfyUI maps these keys through its "
                   "FLUX diffusers key map (flux_to_diffusers)")

def adapter_runtimes(path: Path, info: Mapping[str, Any]) -> list[Verdict]:
    """The same question for a LoRA / LyCORIS file, from `describe_adapter`'s facts."""
    q = shlex.quote(str(path))
    out = shlex.quote(f"{Path(path).stem}-{{}}")
    lycoris = bool(set(info["kinds"]) & {"lokr", "loha", "diff"})
    original = info["naming"] == "original"
    merge = f"port merge BASE {q} --out merged"
    to_original = f"port convert {q} --to original --out {out.format('original')}"
    verdicts = []
    if lycoris:
        verdicts.append(Verdict("diffusers load_lora_weights", NEVER, "LoKr / LoHa / diff modules load with no effect "
                                "in diffusers 0.42 (huggingface/diffusers#13137, #13261); bake them in instead",
                                merge))
    elif original:
        verdicts.append(Verdict("diffusers load_lora_weights", AFTER, "convert writes diffusers / peft naming",
                                f"port convert {q} --out {out.format('diffusers')}"))
    else:
        verdicts.append(Verdict("diffusers load_lora_weights", AS_IS, "diffusers / peft naming (needs peft)"))
    comfy = _comfy_adapter(info, to_original)
    verdicts.append(comfy)
    verdicts.append(Verdict("ComfyUI-GGUF", comfy.status, "LoRAs go through ComfyUI's own loader onto GGUF models"
                            + (f"; {comfy.detail}" if comfy.status == UNKNOWN else ""), comfy.command))
    if info["family"] == "flux2":
        verdicts.append(Verdict("BFL reference code", NEVER, f"{BFL_FLUX2_READ} has no adapter loader; bake the "
                                "adapter into the base", merge))
    else:
        verdicts.append(Verdict("BFL reference code", UNKNOWN, "black-forest-labs/flux has a LoRA path for its own "
                                "control LoRAs; whether it takes this file was not read"))
    return verdicts
