"""FLUX.1's exportable components (dev, schnell): `FluxTransformer2DModel` with its pooled text input and, for dev,
guidance; `AutoencoderKL.decode`; the CLIP text encoder's pooled output and the T5 encoder's last hidden state, with
example inputs built as `FluxPipeline` builds them. Imported by `port export` only (torch, diffusers and
transformers are loaded here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from porting.families.export_spec import (
    Component,
    ExportSpec,
    Traceable,
    count_diffusers,
    count_meta,
    load_vae_decoder,
    quiet_from_pretrained,
)

from .base import Family, PipelineVariant


class TransformerGraph(nn.Module):
    """FluxTransformer2DModel.forward with FluxPipeline's keyword names as graph inputs (schnell: no guidance).

    The ids are FluxPipeline's: one (tokens, 3) table shared by the batch, not one per row as in FLUX.2."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                          txt_ids=txt_ids, return_dict=False)[0]


class GuidedTransformerGraph(TransformerGraph):
    """FLUX.1 [dev] (guidance-distilled): the same plus `guidance`, the guidance scale (the model scales it by 1000)."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                          txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]


class ClipPooledGraph(nn.Module):
    """CLIPTextModel's pooled output, as FluxPipeline._get_clip_prompt_embeds takes it (no attention mask)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, output_hidden_states=False).pooler_output


class T5HiddenGraph(nn.Module):
    """T5EncoderModel's last hidden state, as FluxPipeline._get_t5_prompt_embeds takes it (no attention mask)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, output_hidden_states=False)[0]


def transformer_example(config: Any, dtype: torch.dtype, batch: int, img_side: int,
                        txt: int) -> dict[str, torch.Tensor]:
    """Inputs as FluxPipeline builds them: packed latents, T5 features, CLIP pooled features, 3-axis ids."""
    from diffusers import FluxPipeline

    gen = torch.Generator().manual_seed(0)
    example = {
        "hidden_states": torch.randn(batch, img_side * img_side, config.in_channels, generator=gen).to(dtype),
        "encoder_hidden_states": torch.randn(batch, txt, config.joint_attention_dim, generator=gen).to(dtype),
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=gen).to(dtype),
        "timestep": torch.full((batch,), 0.5, dtype=dtype),
        "img_ids": FluxPipeline._prepare_latent_image_ids(batch, img_side, img_side, "cpu", dtype),
        "txt_ids": torch.zeros(txt, 3, dtype=dtype),
    }
    if config.guidance_embeds:
        example["guidance"] = torch.full((batch,), 3.5, dtype=dtype)
    return example


def load_transformer(folder: Path, dtype: torch.dtype) -> Traceable:
    from diffusers import FluxTransformer2DModel

    model = quiet_from_pretrained(FluxTransformer2DModel, folder, dtype)
    example = transformer_example(model.config, dtype, batch=2, img_side=4, txt=6)
    dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"},
               "encoder_hidden_states": {0: "batch", 1: "text_tokens"}, "pooled_projections": {0: "batch"},
               "timestep": {0: "batch"}, "img_ids": {0: "image_tokens"}, "txt_ids": {0: "text_tokens"}}
    graph: nn.Module = TransformerGraph(model)
    if model.config.guidance_embeds:
        dynamic["guidance"] = {0: "batch"}
        graph = GuidedTransformerGraph(model)
    return Traceable(graph, example, dynamic, ["sample"],
                     {"timestep": "sigma in [0, 1] (the pipeline's t / 1000)",
                      "ids": "img_ids (image_tokens, 3) and txt_ids (text_tokens, 3), shared by the batch",
                      **({"guidance": "the guidance scale (e.g. 3.5)"} if model.config.guidance_embeds else {})})


def _text_loader(cls_name: str, graph: type[nn.Module], output: str, what: str) -> Any:
    def load(folder: Path, dtype: torch.dtype) -> Traceable:
        import transformers

        encoder = quiet_from_pretrained(getattr(transformers, cls_name), folder, dtype)
        ids = torch.randint(0, encoder.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
        return Traceable(graph(encoder), {"input_ids": ids}, {"input_ids": {0: "batch", 1: "text_tokens"}},
                         [output], {"output": what})
    return load


def _text_counter(cls_name: str) -> Any:
    def count(folder: Path) -> int:
        import transformers

        cls = getattr(transformers, cls_name)
        cfg = cls.config_class.from_pretrained(folder, local_files_only=True)
        return count_meta(lambda: cls(cfg))
    return count


def _vae_facts(config: Any) -> dict[str, Any]:
    return {"input": "unpacked latents / scaling_factor + shift_factor (FluxPipeline does this before decoding)",
            "scaling_factor": config.scaling_factor, "shift_factor": config.shift_factor}


def export_spec(family: Family, config: Mapping[str, Any], variant: PipelineVariant | None,
                variant_name: str | None) -> ExportSpec:
    guided = bool(config.get("guidance_embeds"))
    return ExportSpec(
        title=variant.title if variant else f"{family.title} [{'dev' if guided else 'schnell'}]",
        components={
            "transformer": Component("transformer", "transformer", load_transformer,
                                     count_diffusers("FluxTransformer2DModel")),
            "vae_decoder": Component("vae_decoder", "vae", load_vae_decoder("AutoencoderKL", _vae_facts),
                                     count_diffusers("AutoencoderKL")),
            "text_encoder": Component("text_encoder", "text_encoder",
                                      _text_loader("CLIPTextModel", ClipPooledGraph, "pooled_prompt_embeds",
                                                   "CLIP pooled output (FluxPipeline's pooled_prompt_embeds)"),
                                      _text_counter("CLIPTextModel")),
            "text_encoder_2": Component("text_encoder_2", "text_encoder_2",
                                        _text_loader("T5EncoderModel", T5HiddenGraph, "prompt_embeds",
                                                     "T5 last hidden state (FluxPipeline's prompt_embeds)"),
                                        _text_counter("T5EncoderModel")),
        },
        copied=("tokenizer", "tokenizer_2", "scheduler"),
    )
