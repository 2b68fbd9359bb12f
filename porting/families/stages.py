"""What a family declares so that `port validate` can run its transformer stage by stage.

A family with stages names a module (`Family.stages_module`) holding `STAGES`, an object with the interface below.
That module imports torch and diffusers, so it is loaded only when a stage runs (`Family.stages()`); this file
imports neither and only describes the contract.

States are plain dicts of tensors. The inputs state (built by `model_inputs`) has the keys `forward_names` maps
onto the diffusers forward's arguments; every stage takes the previous stage's state, the last (`final`) returns
`{"out": ...}`, the transformer's output. A value that is a tuple of tensors (RoPE tables) keeps its dtype when a
runner casts a state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    import torch

State = dict[str, Any]


class TransformerStages(Protocol):
    forward_names: Mapping[str, str]  # inputs-state key -> the diffusers model's forward argument
    labels: Mapping[str, str]  # original (BFL) names of the non-block stages, for reports
    text_encoders: tuple[str, ...]  # the base's folders the prompt is encoded with (all loaded at once)

    def names(self, model: torch.nn.Module) -> list[str]:
        """Stage names in order: `embed`, one per block (its module path), `final`."""
        ...

    def modules(self, stage: str) -> list[str]:
        """Submodule paths whose weights a stage needs (materialised before it runs, released after)."""
        ...

    def forward(self, model: torch.nn.Module, stage: str, state: State) -> State:
        """One stage, calling the diffusers model's own submodules in the order of its forward."""
        ...

    def residual(self, stage: str, state: State) -> torch.Tensor | None:
        """The residual stream entering a block (None for stages without a residual connection)."""
        ...

    def judged(self, stage: str, state: State) -> torch.Tensor:
        """The tensor a stage's output is judged by."""
        ...

    def latent_shape(self, config: Mapping[str, Any], resolution: int) -> tuple[int, ...]:
        """One image's latents as the family's pipeline draws them (before packing)."""
        ...

    def text_shapes(self, config: Mapping[str, Any], text_len: int) -> dict[str, tuple[int, ...]]:
        """One prompt's text features by inputs-state key (e.g. `ctx`, and `pooled` where the model has it)."""
        ...

    def model_inputs(self, config: Mapping[str, Any], latents: torch.Tensor, text: Mapping[str, torch.Tensor],
                     timesteps: torch.Tensor) -> State:
        """The inputs state for a batch: packed latents, position ids, text features, timesteps, guidance."""
        ...

    def encode_prompt(self, base: Path, prompt: str, text_len: int, config: Mapping[str, Any],
                      text_encoder: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Text features of `prompt` from the base's own text encoders, as the family's pipeline computes them,
        and a description for the report. `text_encoder`: a module standing in for the encoder a 4-bit file
        replaces (Qwen3 for klein, T5 for FLUX.1): the features come from it, the description records their
        error against the base's own (`prompt_features_error`)."""
        ...

    def forward_kwargs(self, state: State) -> dict[str, Any]:
        """The inputs state as keyword arguments of the diffusers forward (an ONNX graph's input names)."""
        ...
