"""What the FLUX.1 and FLUX.2 stages share (see `stages.TransformerStages`): the stage list, the residual stream,
and the inputs-state keys. Imports torch: loaded only through `Family.stages()`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from porting.errors import InputError

State = dict[str, Any]
ROPE = "rope"  # the (cos, sin) RoPE tables: float32 whatever the run's dtype, as in the diffusers forward
DOUBLE, SINGLE = "transformer_blocks", "single_transformer_blocks"
VAE_SCALE = 8  # both FLUX VAEs downsample by 8; the pipelines then pack 2x2 patches into tokens


class FluxStages(ABC):
    embed_modules: tuple[str, ...] = ()
    embed_judged: tuple[str, ...] = ()  # state keys the embed stage is judged by
    final_modules: tuple[str, ...] = ("norm_out", "proj_out")
    guidance_scale: float = 0.0  # the family's pipeline default, fed to guidance-distilled models
    labels: Mapping[str, str] = {}
    text_encoders: tuple[str, ...] = ("text_encoder",)
    forward_names: Mapping[str, str] = {"x": "hidden_states", "ctx": "encoder_hidden_states",
                                        "timestep": "timestep", "img_ids": "img_ids", "txt_ids": "txt_ids",
                                        "guidance": "guidance"}

    def names(self, model: nn.Module) -> list[str]:
        return (["embed"] + [f"{DOUBLE}.{i}" for i in range(len(model.get_submodule(DOUBLE)))]
                + [f"{SINGLE}.{i}" for i in range(len(model.get_submodule(SINGLE)))] + ["final"])

    def modules(self, stage: str) -> list[str]:
        if stage == "embed":
            return list(self.embed_modules)
        if stage == "final":
            return list(self.final_modules)
        return [stage]

    def forward(self, model: nn.Module, stage: str, state: State) -> State:
        if stage == "embed":
            return self.embed(model, state)
        if stage == "final":
            return self.final(model, state)
        block = model.get_submodule(stage)
        if stage.startswith(DOUBLE + "."):
            return self.double(block, state)
        if stage.startswith(SINGLE + "."):
            return self.single(block, state)
        raise KeyError(f"no stage {stage!r}")

    @abstractmethod
    def embed(self, model: nn.Module, s: State) -> State:
        ...

    @abstractmethod
    def double(self, block: nn.Module, s: State) -> State:
        ...

    @abstractmethod
    def single(self, block: nn.Module, s: State) -> State:
        ...

    @abstractmethod
    def final(self, model: nn.Module, s: State) -> State:
        ...

    @staticmethod
    def stream(s: State) -> torch.Tensor:
        """The joint residual stream, text tokens first."""
        return s["joint"] if "joint" in s else torch.cat([s["txt"], s["img"]], dim=1)

    def residual(self, stage: str, state: State) -> torch.Tensor | None:
        return self.stream(state) if stage.startswith((DOUBLE + ".", SINGLE + ".")) else None

    def judged(self, stage: str, state: State) -> torch.Tensor:
        if stage == "embed":
            return torch.cat([state[k].reshape(-1) for k in self.embed_judged])
        if stage.startswith((DOUBLE + ".", SINGLE + ".")):
            return self.stream(state)
        return state["out"]

    def forward_kwargs(self, state: State) -> dict[str, Any]:
        return {name: state[key] for key, name in self.forward_names.items() if key in state}

    @staticmethod
    def scaled_times(s: State, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Timestep and guidance as the diffusers forwards scale them (x 1000, in the hidden states' dtype)."""
        guidance = s.get("guidance")
        return (s["timestep"].to(dtype) * 1000,
                None if guidance is None else guidance.to(dtype) * 1000)

    def guidance(self, config: Mapping[str, Any], batch: int) -> dict[str, torch.Tensor]:
        return {"guidance": torch.full((batch,), self.guidance_scale)} if config.get("guidance_embeds") else {}


def pipeline_class_name(base: Path) -> str | None:
    """The pipeline class a diffusers base folder declares (model_index.json), or None without one."""
    index = base / "model_index.json"
    if not index.is_file():
        return None
    from porting._files import parse_json

    data = parse_json(index.read_bytes(), str(index), kind=dict)
    name = data.get("_class_name")
    return name if isinstance(name, str) else None


def require_folders(base: Path, folders: Sequence[str]) -> None:
    missing = [f for f in folders if not (base / f).is_dir()]
    if missing:
        raise InputError(f"{base}: no {', '.join(f + '/' for f in missing)} folder(s) to encode the prompt with.",
                         hint="Point --base at the diffusers base model (port fetch fills <recipe>/base/).")


def encoder_layers(n_layers: int, wanted: Sequence[int]) -> tuple[int, ...]:
    """The pipeline's hidden-state layers, or for a smaller text encoder (tests, demo) the same relative depths."""
    if max(wanted) <= n_layers:
        return tuple(wanted)
    return tuple(max(1, round(n_layers * k / len(wanted))) for k in range(1, len(wanted) + 1))


def features_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 distance of prompt features from the base encoder's."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def description(encoders: Sequence[nn.Module], prompt: str, **extra: Any) -> dict[str, Any]:
    return {"text_features": "prompt", "prompt": prompt,
            "text_encoder": ", ".join(type(e).__name__ for e in encoders), **extra}

