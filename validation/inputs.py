"""Realistic transformer inputs, built the way the family's diffusers pipeline builds them, on CPU generators.

The family's stages (`porting.families.stages`) say the latents' shape, the text features (synthetic, or a prompt
encoded by the base's own text encoders) and how the pipeline packs them into the model's inputs (ids, guidance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from porting.errors import InputError, PortError
from porting.families import Family, family_for_class

TOKEN_SIDE = 16  # both FLUX VAEs downsample by 8 and the pipelines pack 2x2 patches into one token


@dataclass
class Inputs:
    state: dict[str, Any]  # the family's inputs state: x, ctx, timestep, img_ids, txt_ids, ... (float32, CPU)
    cases: list[dict[str, Any]]  # one per batch row: seed, timestep
    description: dict[str, Any] = field(default_factory=dict)


def build_inputs(config: Mapping[str, Any], resolution: int = 512, text_len: int = 512,
                 timesteps: Sequence[float] = (1.0, 0.5, 0.1), seeds: Sequence[int] = (0,),
                 base: Path | None = None, prompt: str | None = None, family: Family | None = None,
                 text_encoder: Any = None) -> Inputs:
    """Packed latents and ids for `resolution`, text features of `text_len` tokens, one row per case.

    `family` defaults to the one whose diffusers class the config names; `text_encoder` (a loaded 4-bit encoder)
    encodes the prompt in place of the base's (its features' error against the base's is described)."""
    if resolution % TOKEN_SIDE:
        raise PortError(f"--resolution {resolution} must be a multiple of {TOKEN_SIDE}.")
    family = family or family_for_class(str(config.get("_class_name")))
    stages = family.stages()
    text_shapes = stages.text_shapes(config, text_len)
    text_desc: dict[str, Any] = {"text_features": "synthetic (standard normal); pass --base with a text encoder "
                                                  "to use a real prompt"}
    prompt_feats: dict[str, torch.Tensor] | None = None
    if base is not None and prompt:
        prompt_feats, text_desc = stages.encode_prompt(Path(base), prompt, text_len, config,
                                                       **({"text_encoder": text_encoder} if text_encoder else {}))
        for key, shape in text_shapes.items():
            got = prompt_feats[key].shape[-1]
            if got != shape[-1]:
                raise InputError(f"{base}: text features {key!r} are {got} wide, the transformer expects {shape[-1]}.",
                                 hint="Is --base the base of this fine-tune?")
    latent_shape = stages.latent_shape(config, resolution)
    latents, texts, ts, cases = [], [], [], []
    for seed in seeds:
        gen = torch.Generator("cpu").manual_seed(int(seed))
        noise = torch.randn(1, *latent_shape, generator=gen)
        clean = torch.randn(1, *latent_shape, generator=gen)
        text = prompt_feats if prompt_feats is not None else {
            key: torch.randn(1, *shape, generator=gen) for key, shape in text_shapes.items()}
        for t in timesteps:
            latents.append(float(t) * noise + (1.0 - float(t)) * clean)  # flow-matching interpolation x_t
            texts.append(text)
            ts.append(float(t))
            cases.append({"seed": int(seed), "timestep": float(t)})
    batch_text = {key: torch.cat([t[key] for t in texts]) for key in text_shapes}
    state = stages.model_inputs(config, torch.cat(latents), batch_text, torch.tensor(ts))
    desc = {"resolution": resolution, "image_tokens": (resolution // TOKEN_SIDE) ** 2, "text_tokens": text_len,
            "timesteps": list(map(float, timesteps)), "seeds": list(map(int, seeds)), "batch": len(cases),
            **({"guidance": float(state["guidance"][0])} if "guidance" in state else {}), **text_desc}
    return Inputs(state, cases, desc)
