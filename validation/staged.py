"""Run a family's diffusers transformer stage by stage with weights materialised only while a stage runs.

The family declares its stages (`porting.families.stages`): for FLUX, `embed`, `transformer_blocks.N`,
`single_transformer_blocks.N` and `final`, each calling the diffusers model's own submodules in the order of its
forward, so per-block hooks and kernels are the real ones. A stage's weights are read from the checkpoint, cast,
used, and dropped back to the meta device, which keeps a float32 golden of a 9B model within a few GB of host memory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from porting.skeleton import diffusers_skeleton, materialise, release

from .weights import WeightSource, WeightTransform

State = dict[str, Any]


def cast_state(state: State, dtype: torch.dtype, device: torch.device) -> State:
    """Floating tensors to `dtype` on `device`; tuples of tensors (RoPE tables) keep their float32 as in the
    diffusers forward."""
    out: State = {}
    for k, v in state.items():
        if isinstance(v, tuple):
            out[k] = tuple(t.to(device) for t in v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
        else:
            out[k] = v
    return out


class StagedModel:
    def __init__(self, source: WeightSource, device: torch.device, dtype: torch.dtype,
                 weight_transform: WeightTransform | None = None, emulate: torch.dtype | None = None,
                 packed: Any = None) -> None:
        """`emulate`: compute in `dtype` (float32) but round weights, inputs and every module's positional inputs and
        outputs to `emulate`, the storage rounding of a bf16 accelerator with float32 accumulation, for hosts whose
        CPU lacks fast bf16. `packed` (`validation.packed.PackedLinears`): the quantized linears of an SVDQuant file
        run packed, as the kernel computes them, instead of as plain linears of the dequantized weights."""
        import diffusers

        self.source, self.device, self.dtype = source, device, dtype
        self.weight_transform = weight_transform
        self.emulate = emulate
        self.packed = packed
        self.stages = source.stages
        cls = getattr(diffusers, source.detection.table.diffusers_class)
        self.model = diffusers_skeleton(cls, source.config)
        self.model.eval().requires_grad_(False)
        if emulate is not None:
            for module in self.model.modules():
                # positional inputs too: what arithmetic between modules computes (a timestep x 1000, a modulated
                # norm) is stored in `emulate` on the device before the next module reads it
                module.register_forward_pre_hook(self._round_inputs)
                module.register_forward_hook(self._round_output)

    def _round(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(self.emulate).to(self.dtype)
        return t

    def _round_inputs(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(self._round(a) for a in args)

    def _round_output(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        return tuple(self._round(o) for o in output) if isinstance(output, tuple) else self._round(output)

    def stage_names(self) -> list[str]:
        return self.stages.names(self.model)

    def stage_input(self, stage: str, state: State) -> torch.Tensor | None:
        """The residual stream entering a block (None for stages without a residual connection)."""
        return self.stages.residual(stage, state)

    def stage_output(self, stage: str, state: State) -> torch.Tensor:
        """The tensor a stage is judged by."""
        return self.stages.judged(stage, state)

    def _modules(self, stage: str) -> list[tuple[str, nn.Module]]:
        return [(n, self.model.get_submodule(n)) for n in self.stages.modules(stage)]

    def materialise(self, stage: str) -> None:
        for prefix, module in self._modules(stage):
            materialise(module, self.device, self.dtype)  # the buffers computed at build keep their values
            if self.packed is not None:  # after materialise: the packed parts are built, not cast
                self.packed.install(prefix, module, self.device, self.emulate)
                if self.emulate is not None:
                    for sub in module.modules():
                        if not sub._forward_pre_hooks:
                            sub.register_forward_pre_hook(self._round_inputs)
                            sub.register_forward_hook(self._round_output)
            with torch.no_grad():
                for name, param in module.named_parameters():
                    key = f"{prefix}.{name}"
                    tensor = self.source.get(key)
                    if self.weight_transform is not None:
                        tensor = self.weight_transform(key, tensor)
                    if self.emulate is not None:
                        tensor = tensor.to(self.emulate)
                    param.copy_(tensor.to(dtype=self.dtype))

    def release(self, stage: str) -> None:
        for prefix, module in self._modules(stage):
            if self.packed is not None:
                self.packed.release(prefix, module)
            release(module)

    def run(self, stage: str, states: list[State]) -> list[State]:
        """Run one stage on several input states with its weights loaded once."""
        self.materialise(stage)
        try:
            with torch.no_grad():
                return [self._forward(stage, self._prepare(s)) for s in states]
        finally:
            self.release(stage)

    def _prepare(self, state: State) -> State:
        if self.emulate is not None:
            state = cast_state(state, self.emulate, self.device)
        return cast_state(state, self.dtype, self.device)

    def forward_all(self, inputs: State, on_stage: Callable[[str], None] | None = None) -> torch.Tensor:
        """A whole forward pass, streamed stage by stage."""
        from .runners.base import forward_all

        return forward_all(self, inputs, on_stage)

    def _forward(self, stage: str, s: State) -> State:
        return self.stages.forward(self.model, stage, s)
