"""FLUX.1 (dev, schnell): BFL naming <-> diffusers `FluxTransformer2DModel`, published as `FluxPipeline`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from porting._files import json_int, read_json_object

from ._flux import common_config, flux_sizes
from .base import Family, PipelineVariant

TINY: dict[str, Any] = {
    "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16, "out_channels": None,
    "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
    "joint_attention_dim": 32, "pooled_projection_dim": 24, "guidance_embeds": True, "axes_dims_rope": [4, 14, 14],
}


class Flux1(Family):
    name = "flux1"
    title = "FLUX.1"
    table_resource = "flux1.toml"
    shapes_resource = "flux1.shapes.toml"
    stages_module = "porting.families.flux1_stages"
    export_module = "porting.families.flux1_export"
    structural_fields = ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                         "joint_attention_dim", "in_channels", "guidance_embeds", "pooled_projection_dim")
    # FluxPipeline: CLIP (pooled) in text_encoder/, T5 (sequence) in text_encoder_2/; dev embeds guidance, schnell
    # is timestep-distilled (4 steps, no guidance embedder); diffusers' FluxPipeline defaults to 28 steps
    pipelines = {
        "flux1-dev": PipelineVariant("FluxPipeline", "CLIPTextModel", True, (), False, "FLUX.1 [dev]",
                                     more_text_encoders=(("text_encoder_2", "T5EncoderModel"),), default_steps=28,
                                     packed_latents=True),
        "flux1-schnell": PipelineVariant("FluxPipeline", "CLIPTextModel", False, (), False, "FLUX.1 [schnell]",
                                         more_text_encoders=(("text_encoder_2", "T5EncoderModel"),),
                                         default_steps=4, packed_latents=True),
    }
    tiny_config = TINY
    real_configs = {
        "FLUX.1-dev": {**TINY, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                       "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                       "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]},
    }
    shape_terms = ("inner_dim", "mlp_hidden", "attention_head_dim", "in_channels", "joint_attention_dim",
                   "pooled_projection_dim", "out_features")
    shape_probes = (
        {**TINY, "num_attention_heads": 5, "attention_head_dim": 14, "in_channels": 22, "joint_attention_dim": 26,
         "pooled_projection_dim": 38, "axes_dims_rope": [2, 6, 6]},
        {**TINY, "num_attention_heads": 3, "attention_head_dim": 22, "in_channels": 17, "out_channels": 19,
         "joint_attention_dim": 29, "pooled_projection_dim": 23, "axes_dims_rope": [2, 10, 10]},
    )

    def derive_config(self, facts: Mapping[str, Any]) -> dict[str, Any]:
        config = common_config(self.diffusers_class, facts)
        head_dim = config["attention_head_dim"]
        config["pooled_projection_dim"] = int(facts["pooled_projection_dim"])
        # released FLUX.1 uses 3-axis RoPE (16, 56, 56) for head_dim 128; other head dims keep the same proportions
        first = head_dim // 8
        rest = (head_dim - first) // 2
        config["axes_dims_rope"] = [16, 56, 56] if head_dim == 128 else [first, rest, head_dim - first - rest]
        return config

    def sizes(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return flux_sizes(config, default_mlp_ratio=4.0)  # FluxTransformer2DModel has a fixed 4.0

    def default_variant(self, config: Mapping[str, Any]) -> str:
        return "flux1-dev" if config.get("guidance_embeds") else "flux1-schnell"

    def pipeline_fit(self, base: Path, config: Mapping[str, Any], variant: PipelineVariant) -> list[str]:
        """CLIP's pooled output (its width) feeds pooled_projection_dim, T5's hidden states (d_model) feed
        joint_attention_dim, and the VAE's latents are packed 2x2 into the transformer's input channels."""
        problems = []
        widths = (("text_encoder", "hidden_size", "pooled_projection_dim", "CLIP width"),
                  ("text_encoder_2", "d_model", "joint_attention_dim", "T5 d_model"))
        for component, field, target, what in widths:
            path = base / component / "config.json"
            if not path.is_file():  # a base without this text encoder: publish names the missing component
                continue
            cfg = read_json_object(path, f"{component} config")
            text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
            width = json_int(text, field, path, minimum=1)
            if config.get(target) != width:
                problems.append(f"{what} {field} {width} ({base / component}), but the transformer's {target} is "
                                f"{config.get(target)}")
        vae_path = base / "vae" / "config.json"
        latent = json_int(read_json_object(vae_path, "VAE config"), "latent_channels", vae_path, default=16, minimum=1)
        if config.get("in_channels") != 4 * latent:
            problems.append(f"VAE latent_channels {latent} x 4 (2x2 packing) = {4 * latent} ({base / 'vae'}), but "
                            f"the transformer's in_channels is {config.get('in_channels')}")
        return problems


FAMILY = Flux1()
