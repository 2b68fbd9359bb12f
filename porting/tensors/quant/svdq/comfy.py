"""The `comfy_config` header entry of a Nunchaku SVDQuant file: the ComfyUI model config that ComfyUI-nunchaku's
loaders build their ComfyUI model from (a JSON object `{"model_class": ..., "model_config": {...}}`).

FLUX.1: nunchaku-tech/ComfyUI-nunchaku `nodes/models/flux.py` (`NunchakuFluxDiTLoader`) parses
`metadata["comfy_config"]` of a single file with no fallback, so a file without it does not load there.
`model_class` ("Flux" or "FluxSchnell") picks ComfyUI's model; `model_config` uses ComfyUI's BFL-style names and
counts the 16 latent channels before ComfyUI's 2x2 patching (diffusers counts the 64 after it). The values follow
the loader's bundled `nodes/models/configs/flux.1-{dev,schnell,fill-dev}.json`.

FLUX.2: the same repository's `nodes/models/flux2.py` (`NunchakuFlux2DiTLoader`) prefers the entry and otherwise
builds these same keys from `config`; written so its `out_channels` is the model's (klein's diffusers config has
`out_channels: null`, which that fallback passes on as null). ComfyUI's `Flux2` model reads `hidden_size`.
"""

from __future__ import annotations

from typing import Any, Mapping

from porting.errors import InternalError

FLUX1_PATCH = 2  # ComfyUI packs 2x2 latent patches itself: diffusers' in_channels are 4x ComfyUI's


def comfy_config(family: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """ComfyUI-nunchaku's `comfy_config` for a model of `family` ("flux1" / "flux2") with diffusers `config`."""
    hidden = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    in_channels = int(config["in_channels"])
    out_channels = int(config.get("out_channels") or in_channels)
    guidance = bool(config.get("guidance_embeds", False))
    if family == "flux1":
        area = FLUX1_PATCH * FLUX1_PATCH
        return {"model_class": "Flux" if guidance else "FluxSchnell", "model_config": {
            "axes_dim": [int(a) for a in config["axes_dims_rope"]],
            "context_in_dim": int(config["joint_attention_dim"]),
            "depth": int(config["num_layers"]),
            "depth_single_blocks": int(config["num_single_layers"]),
            "disable_unet_model_creation": True,
            "guidance_embed": guidance,
            "hidden_size": hidden,
            "image_model": "flux",
            "in_channels": in_channels // area,
            "mlp_ratio": 4.0,  # fixed in FluxTransformer2DModel
            "num_heads": int(config["num_attention_heads"]),
            "out_channels": out_channels // area,
            "patch_size": FLUX1_PATCH,
            "qkv_bias": True,
            "theta": 10000,  # FluxTransformer2DModel's RoPE theta
            "vec_in_dim": int(config["pooled_projection_dim"]),
        }}
    if family == "flux2":
        return {"model_class": "Flux2", "model_config": {
            "image_model": "flux2",
            "guidance_embed": guidance,
            "hidden_size": hidden,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "patch_size": int(config.get("patch_size") or 1),
            "disable_unet_model_creation": True,
        }}
    raise InternalError(f"no ComfyUI-nunchaku model config for family {family!r}")


__all__ = ["comfy_config"]
