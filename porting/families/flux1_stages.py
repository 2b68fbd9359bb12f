"""FLUX.1 stages (`FluxTransformer2DModel`: dev with guidance, schnell without), inputs as `FluxPipeline` builds them.

Stages call the diffusers model's own submodules in the order of `FluxTransformer2DModel.forward`: `embed` (time,
guidance and pooled-text embedding, x and context embedders, RoPE over text then image ids, 3 axes), the double
blocks, the single blocks (which in diffusers take and return the text and image streams separately) and `final` on
the image tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ._flux_stages import ROPE, VAE_SCALE, FluxStages, State, description, features_error, require_folders

POOLED = "pooled"


class Flux1Stages(FluxStages):
    embed_modules = ("time_text_embed", "x_embedder", "context_embedder")
    embed_judged = ("img", "txt", "temb")
    guidance_scale = 3.5  # FluxPipeline's default guidance_scale
    labels = {"embed": "img_in, txt_in, time_in, vector_in, guidance_in", "final": "final_layer"}
    text_encoders = ("text_encoder", "text_encoder_2")  # CLIP (pooled) and T5 (sequence), loaded together
    forward_names = {**FluxStages.forward_names, POOLED: "pooled_projections"}

    def embed(self, m: nn.Module, s: State) -> State:
        img = m.x_embedder(s["x"])
        timestep, guidance = self.scaled_times(s, img.dtype)
        temb = (m.time_text_embed(timestep, s[POOLED]) if guidance is None
                else m.time_text_embed(timestep, guidance, s[POOLED]))
        txt_ids = s["txt_ids"][0] if s["txt_ids"].ndim == 3 else s["txt_ids"]
        img_ids = s["img_ids"][0] if s["img_ids"].ndim == 3 else s["img_ids"]
        return {"temb": temb, "img": img, "txt": m.context_embedder(s["ctx"]),
                ROPE: m.pos_embed(torch.cat((txt_ids, img_ids), dim=0))}

    def double(self, block: nn.Module, s: State) -> State:
        txt, img = block(hidden_states=s["img"], encoder_hidden_states=s["txt"], temb=s["temb"],
                         image_rotary_emb=s[ROPE], joint_attention_kwargs=None)
        return {"temb": s["temb"], ROPE: s[ROPE], "img": img, "txt": txt}

    single = double  # FluxSingleTransformerBlock has the same signature and returns (text, image) too

    def final(self, m: nn.Module, s: State) -> State:
        return {"out": m.proj_out(m.norm_out(s["img"], s["temb"]))}

    # ------------------------------------------------------------------------------------------------ inputs

    def latent_shape(self, config: Mapping[str, Any], resolution: int) -> tuple[int, ...]:
        side = 2 * (resolution // (VAE_SCALE * 2))  # FluxPipeline.prepare_latents: VAE latents, packed 2x2 later
        return (int(config["in_channels"]) // 4, side, side)

    def text_shapes(self, config: Mapping[str, Any], text_len: int) -> dict[str, tuple[int, ...]]:
        return {"ctx": (text_len, int(config["joint_attention_dim"])),
                POOLED: (int(config["pooled_projection_dim"]),)}

    def model_inputs(self, config: Mapping[str, Any], latents: torch.Tensor, text: Mapping[str, torch.Tensor],
                     timesteps: torch.Tensor) -> State:
        from diffusers import FluxPipeline

        b, c, h, w = latents.shape
        ctx = text["ctx"]
        return {"x": FluxPipeline._pack_latents(latents, b, c, h, w), "ctx": ctx, POOLED: text[POOLED],
                "timestep": timesteps,
                "img_ids": FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32),
                "txt_ids": torch.zeros(ctx.shape[1], 3),  # FluxPipeline.encode_prompt's text_ids
                **self.guidance(config, b)}

    def encode_prompt(self, base: Path, prompt: str, text_len: int, config: Mapping[str, Any],
                      text_encoder: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """CLIP's pooled output and T5's sequence, through `FluxPipeline.encode_prompt` itself; `text_encoder` (a
        4-bit T5) in place of the base's T5."""
        from diffusers import FluxPipeline
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        require_folders(base, ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
        clip = CLIPTextModel.from_pretrained(base / "text_encoder", dtype=torch.float32, local_files_only=True)
        t5 = T5EncoderModel.from_pretrained(base / "text_encoder_2", dtype=torch.float32, local_files_only=True)
        pipe = FluxPipeline(scheduler=None, vae=None, transformer=None, text_encoder=clip, text_encoder_2=t5,
                            tokenizer=AutoTokenizer.from_pretrained(base / "tokenizer", local_files_only=True),
                            tokenizer_2=AutoTokenizer.from_pretrained(base / "tokenizer_2", local_files_only=True))
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=torch.device("cpu"),
                                                   max_sequence_length=text_len)
            extra: dict[str, Any] = {}
            if text_encoder is not None:
                pipe.text_encoder_2 = text_encoder
                four, _, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=torch.device("cpu"),
                                                max_sequence_length=text_len)
                extra = {"text_encoder_4bit": True, "prompt_features_error": features_error(four, embeds)}
                embeds, t5 = four, text_encoder
        return {"ctx": embeds.float(), POOLED: pooled.float()}, description([clip, t5], prompt, **extra)


STAGES = Flux1Stages()
