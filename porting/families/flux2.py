"""FLUX.2 (klein 4B / 9B / 9B-KV, dev): Black Forest Labs naming <-> diffusers `Flux2Transformer2DModel`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from porting._files import json_int, read_config, read_json_object
from porting.errors import InputError

from ._flux import common_config, flux_sizes
from .base import Family, PipelineVariant

TINY: dict[str, Any] = {
    "_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 16, "out_channels": None,
    "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
    "joint_attention_dim": 48, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
    "axes_dims_rope": [4, 4, 4, 4], "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": False,
}

# Real sizes (flux2-checkpoints.md section 2.2); used header-only by plans and by the benchmarks.
REAL: dict[str, dict[str, Any]] = {
    "klein-4b": {**TINY, "in_channels": 128, "num_layers": 5, "num_single_layers": 20,
                 "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
                 "axes_dims_rope": [32, 32, 32, 32]},
    "klein-9b": {**TINY, "in_channels": 128, "num_layers": 8, "num_single_layers": 24,
                 "attention_head_dim": 128, "num_attention_heads": 32, "joint_attention_dim": 12288,
                 "axes_dims_rope": [32, 32, 32, 32]},
    "flux2-dev": {**TINY, "in_channels": 128, "num_layers": 8, "num_single_layers": 48,
                  "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360,
                  "axes_dims_rope": [32, 32, 32, 32], "guidance_embeds": True},
}


class Flux2(Family):
    name = "flux2"
    title = "FLUX.2"
    table_resource = "flux2.toml"
    adapter_priority = 1  # a LoRA on modules FLUX.1 shares (qkv, linear1) is read as FLUX.2
    single_file_strips_prefix = False  # its converter looks keys up as they are: KeyError on a prefix
    stages_module = "porting.families.flux2_stages"
    export_module = "porting.families.flux2_export"
    shapes_resource = "flux2.shapes.toml"
    # a fine-tune must agree with its base on these
    structural_fields = ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                         "joint_attention_dim", "in_channels", "guidance_embeds", "mlp_ratio",
                         "timestep_guidance_channels")
    # flux2-checkpoints.md section 8: pipeline classes, their text encoders and default hidden-state layers
    pipelines = {
        "klein": PipelineVariant("Flux2KleinPipeline", "Qwen3ForCausalLM", False, (9, 18, 27), True,
                                 "FLUX.2 [klein]"),
        "klein-kv": PipelineVariant("Flux2KleinKVPipeline", "Qwen3ForCausalLM", False, (9, 18, 27), False,
                                    "FLUX.2 [klein] KV", default_steps=4),
        "dev": PipelineVariant("Flux2Pipeline", "Mistral3ForConditionalGeneration", True, (10, 20, 30), False,
                               "FLUX.2 [dev]"),
    }
    tiny_config = TINY
    real_configs = REAL
    shape_terms = ("inner_dim", "mlp_hidden", "attention_head_dim", "in_channels", "joint_attention_dim",
                   "timestep_guidance_channels", "out_features")
    # sizes chosen so that no two small multiples or sums of them coincide
    shape_probes = (
        {**TINY, "num_attention_heads": 5, "attention_head_dim": 7, "mlp_ratio": 2.6, "in_channels": 22,
         "joint_attention_dim": 26, "timestep_guidance_channels": 38, "axes_dims_rope": [1, 2, 2, 2]},
        {**TINY, "num_attention_heads": 4, "attention_head_dim": 11, "mlp_ratio": 3.0, "in_channels": 17,
         "out_channels": 19, "joint_attention_dim": 29, "timestep_guidance_channels": 23,
         "axes_dims_rope": [2, 3, 3, 3]},
    )

    def derive_config(self, facts: Mapping[str, Any]) -> dict[str, Any]:
        config = common_config(self.diffusers_class, facts)
        head_dim = config["attention_head_dim"]
        config.update({
            "timestep_guidance_channels": int(facts["timestep_guidance_channels"]),
            "mlp_ratio": facts["mlp_hidden"] / int(facts["inner_dim"]),
            "axes_dims_rope": [head_dim // 4] * 4,
            "rope_theta": 2000,
            "eps": 1e-6,
        })
        return config

    def sizes(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return flux_sizes(config, default_mlp_ratio=3.0)

    def default_variant(self, config: Mapping[str, Any]) -> str:
        return "dev" if config.get("guidance_embeds") else "klein"

    def pipeline_fit(self, base: Path, config: Mapping[str, Any], variant: PipelineVariant) -> list[str]:
        """The text encoder feeds 3 stacked hidden states (joint_attention_dim = 3 x hidden) from the layers the
        pipeline reads; the VAE's latents are patchified 2x2 into the transformer's input channels."""
        problems = []
        te_path = base / "text_encoder" / "config.json"
        te_cfg = read_json_object(te_path, "text encoder config")
        text = te_cfg.get("text_config") if isinstance(te_cfg.get("text_config"), dict) else te_cfg
        hidden = json_int(text, "hidden_size", te_path, minimum=1)
        layers = json_int(text, "num_hidden_layers", te_path, minimum=1)
        jad = config.get("joint_attention_dim")
        if jad != 3 * hidden:
            problems.append(f"text encoder hidden_size {hidden} x 3 = {3 * hidden} ({base / 'text_encoder'}), but "
                            f"the transformer's joint_attention_dim is {jad}")
        if layers < max(variant.out_layers):
            problems.append(f"text encoder has {layers} hidden layers; {variant.pipeline} reads layers "
                            f"{list(variant.out_layers)} by default")
        vae_path = base / "vae" / "config.json"
        vae_cfg = read_config(vae_path, "VAE config")
        patch = vae_cfg.get("patch_size") or [2, 2]
        if not (isinstance(patch, list) and len(patch) == 2 and all(type(n) is int and n > 0 for n in patch)):
            raise InputError(f"{vae_path}: 'patch_size' is {patch!r}; it must be two positive integers.")
        latent, patch_area = json_int(vae_cfg, "latent_channels", vae_path, default=32, minimum=1), patch[0] * patch[1]
        if config.get("in_channels") != latent * patch_area:
            problems.append(f"VAE latent_channels {latent} x {patch_area} (2x2 patches) = {latent * patch_area} "
                            f"({base / 'vae'}), but the transformer's in_channels is {config.get('in_channels')}")
        return problems


FAMILY = Flux2()
