"""Realistic transformer inputs, built the way the diffusers klein pipeline builds them, on CPU generators."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from porting.errors import InputError, PortError

VAE_SCALE = 8  # FLUX.2 VAE downsamples by 8; the pipeline then packs 2x2 patches


@dataclass
class Inputs:
    state: dict[str, Any]  # x, ctx, timestep, img_ids, txt_ids (float32, CPU)
    cases: list[dict[str, Any]]  # one per batch row: seed, timestep
    description: dict[str, Any] = field(default_factory=dict)


def _encoder_layers(n_layers: int, wanted: Sequence[int]) -> tuple[int, ...]:
    if max(wanted) <= n_layers:
        return tuple(wanted)
    # a smaller text encoder than Qwen3 (tests, demo): the same relative depths
    return tuple(max(1, round(n_layers * k / 3)) for k in (1, 2, 3))


def encode_prompt(base: Path, prompt: str, text_len: int,
                  layers: Sequence[int] = (9, 18, 27)) -> tuple[torch.Tensor, dict[str, Any]]:
    """Prompt features from the base model's own Qwen3 text encoder, as Flux2KleinPipeline computes them."""
    from diffusers import Flux2KleinPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    enc_dir, tok_dir = base / "text_encoder", base / "tokenizer"
    if not enc_dir.is_dir() or not tok_dir.is_dir():
        raise InputError(f"{base}: no text_encoder/ and tokenizer/ folders to encode the prompt with.",
                         hint="Point --base at the diffusers base model (port fetch fills <recipe>/base/).")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    encoder = AutoModelForCausalLM.from_pretrained(enc_dir, dtype=torch.float32, local_files_only=True)
    used = _encoder_layers(encoder.config.num_hidden_layers, layers)
    with torch.no_grad():
        feats = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder=encoder, tokenizer=tokenizer, prompt=[prompt], device=torch.device("cpu"),
            max_sequence_length=text_len, hidden_states_layers=used)
    return feats.float(), {"text_features": "prompt", "prompt": prompt, "text_encoder_layers": list(used),
                           "text_encoder": encoder.__class__.__name__}


def build_inputs(config: Mapping[str, Any], resolution: int = 512, text_len: int = 512,
                 timesteps: Sequence[float] = (1.0, 0.5, 0.1), seeds: Sequence[int] = (0,),
                 base: Path | None = None, prompt: str | None = None) -> Inputs:
    """Packed latents and 4-axis ids for `resolution`, text features of `text_len` tokens, one row per case."""
    from diffusers import Flux2KleinPipeline

    if resolution % (VAE_SCALE * 2):
        raise PortError(f"--resolution {resolution} must be a multiple of {VAE_SCALE * 2}.")
    channels, joint = int(config["in_channels"]), int(config["joint_attention_dim"])
    side = resolution // (VAE_SCALE * 2)
    text_desc: dict[str, Any] = {"text_features": "synthetic (standard normal); pass --base with a text encoder "
                                                  "to use a real prompt"}
    prompt_feats = None
    if base is not None and prompt:
        prompt_feats, text_desc = encode_prompt(Path(base), prompt, text_len)
        if prompt_feats.shape[-1] != joint:
            raise InputError(f"{base}: text features are {prompt_feats.shape[-1]} wide, the transformer expects "
                             f"joint_attention_dim {joint}.", hint="Is --base the base of this fine-tune?")
    xs, ctxs, ts, cases = [], [], [], []
    for seed in seeds:
        gen = torch.Generator("cpu").manual_seed(int(seed))
        noise = torch.randn(1, channels, side, side, generator=gen)
        clean = torch.randn(1, channels, side, side, generator=gen)
        ctx = prompt_feats if prompt_feats is not None else torch.randn(1, text_len, joint, generator=gen)
        for t in timesteps:
            latents = float(t) * noise + (1.0 - float(t)) * clean  # flow-matching interpolation x_t
            xs.append(Flux2KleinPipeline._pack_latents(latents))
            ctxs.append(ctx)
            ts.append(float(t))
            cases.append({"seed": int(seed), "timestep": float(t)})
    x = torch.cat(xs)
    ctx = torch.cat(ctxs)
    img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.empty(len(cases), channels, side, side))
    txt_ids = Flux2KleinPipeline._prepare_text_ids(ctx)
    state = {"x": x, "ctx": ctx, "timestep": torch.tensor(ts), "img_ids": img_ids, "txt_ids": txt_ids}
    if config.get("guidance_embeds"):
        state["guidance"] = torch.full((len(cases),), 4.0)
    desc = {"resolution": resolution, "image_tokens": side * side, "text_tokens": text_len,
            "timesteps": list(map(float, timesteps)), "seeds": list(map(int, seeds)), "batch": len(cases),
            **text_desc}
    return Inputs(state, cases, desc)
