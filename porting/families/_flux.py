"""What FLUX.1 and FLUX.2 share: the part of the diffusers config that shapes give directly."""

from __future__ import annotations

from typing import Any, Mapping


def common_config(class_name: str, facts: Mapping[str, Any]) -> dict[str, Any]:
    head_dim = int(facts["attention_head_dim"])
    inner = int(facts["inner_dim"])
    in_channels = int(facts["in_channels"])
    out_features = int(facts["out_features"])
    return {
        "_class_name": class_name,
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


def flux_sizes(config: Mapping[str, Any], default_mlp_ratio: float) -> dict[str, Any]:
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    mlp_ratio = config.get("mlp_ratio", default_mlp_ratio)
    sizes = {**config, "inner_dim": inner, "mlp_hidden": int(inner * mlp_ratio)}
    out = config.get("out_channels") or config.get("in_channels")
    if out is not None:
        sizes["out_features"] = int(out)
    return sizes
