"""The protocol between `validate` and whatever computes the transformer.

A runner exposes its stage names and runs one stage on a list of input states (dicts of tensors, see
`validation.staged` and the family's stages, `porting.families.stages`). The final state of every runner holds
`out`, the transformer's output. A runner that can stop between blocks (`localises = True`) lets the lock-step
comparison feed each block the golden's inputs and blame the first bad block; a whole-graph runner (an ONNX session)
has the single stage `WHOLE`, which takes the family's inputs state (`x`, `ctx`, `timestep`, `img_ids`, `txt_ids`,
and `guidance` / `pooled` where the model has them) and returns `{"out": ...}`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

State = dict[str, Any]
WHOLE = "output"


@runtime_checkable
class Runner(Protocol):
    runtime: str  # "torch", "onnxruntime", ...
    device: Any  # where it runs: a torch.device, or a label such as onnxruntime:CPUExecutionProvider
    dtype: torch.dtype
    localises: bool  # True: one stage per block; False: the single stage WHOLE
    localisation_note: str  # why there is no per-block check (read when localises is False)

    def stage_names(self) -> list[str]: ...

    def run(self, stage: str, states: list[State]) -> list[State]: ...

    def facts(self) -> dict[str, Any]:
        """What the report records about the runtime and device."""
        ...


def forward_all(runner: Runner, inputs: State, on_stage: Callable[[str], None] | None = None) -> torch.Tensor:
    """A whole forward pass through any runner, stage by stage."""
    state = inputs
    for stage in runner.stage_names():
        state = runner.run(stage, [state])[0]
        if on_stage:
            on_stage(stage)
    return state["out"]
