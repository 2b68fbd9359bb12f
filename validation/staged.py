"""Run `Flux2Transformer2DModel` stage by stage with weights materialised only while a stage runs.

Stages are `embed`, `transformer_blocks.N`, `single_transformer_blocks.N` and `final`; each calls the diffusers
model's own submodules in the order of `Flux2Transformer2DModel.forward`, so per-block hooks and kernels are the
real ones. A stage's weights are read from the checkpoint, cast, used, and dropped back to the meta device, which
keeps a float32 golden of a 9B model within a few GB of host memory.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from .weights import WeightSource, WeightTransform

State = dict[str, Any]
ROPE = "rope"


def cast_state(state: State, dtype: torch.dtype, device: torch.device) -> State:
    """Floating tensors to `dtype` on `device`; RoPE tables keep their float32 as in the diffusers forward."""
    out: State = {}
    for k, v in state.items():
        if k == ROPE:
            out[k] = tuple(t.to(device) for t in v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
        else:
            out[k] = v
    return out


def stage_input(stage: str, state: State) -> torch.Tensor | None:
    """The residual stream entering a block (None for stages without a residual connection)."""
    if stage.startswith("transformer_blocks."):
        return torch.cat([state["txt"], state["img"]], dim=1)
    if stage.startswith("single_transformer_blocks."):
        return state["joint"] if "joint" in state else torch.cat([state["txt"], state["img"]], dim=1)
    return None


def stage_output(stage: str, state: State) -> torch.Tensor:
    """The tensor a stage is judged by."""
    if stage == "embed":
        parts = [state["img"], state["txt"], state["mod_img"], state["mod_txt"], state["mod_single"]]
        return torch.cat([p.reshape(-1) for p in parts])
    if stage.startswith("transformer_blocks."):
        return torch.cat([state["txt"], state["img"]], dim=1)
    if stage.startswith("single_transformer_blocks."):
        return state["joint"]
    return state["out"]


class StagedFlux2:
    def __init__(self, source: WeightSource, device: torch.device, dtype: torch.dtype,
                 weight_transform: WeightTransform | None = None, emulate: torch.dtype | None = None) -> None:
        """`emulate`: compute in `dtype` (float32) but round weights, inputs and every module output to `emulate`,
        the storage rounding of a bf16 accelerator with float32 accumulation, for hosts whose CPU lacks fast bf16."""
        import diffusers

        self.source, self.device, self.dtype = source, device, dtype
        self.weight_transform = weight_transform
        self.emulate = emulate
        cls = getattr(diffusers, source.detection.table.diffusers_class)
        clean = {k: v for k, v in source.config.items() if not k.startswith("_")}
        log = logging.getLogger("diffusers")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            with torch.device("meta"):
                self.model = cls.from_config(clean)
        finally:
            log.setLevel(level)
        self.model.eval().requires_grad_(False)
        if emulate is not None:
            for module in self.model.modules():
                module.register_forward_hook(self._round_output)

    def _round(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(self.emulate).to(self.dtype)
        return t

    def _round_output(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        return tuple(self._round(o) for o in output) if isinstance(output, tuple) else self._round(output)

    def stage_names(self) -> list[str]:
        m = self.model
        return (["embed"] + [f"transformer_blocks.{i}" for i in range(len(m.transformer_blocks))]
                + [f"single_transformer_blocks.{i}" for i in range(len(m.single_transformer_blocks))] + ["final"])

    def _modules(self, stage: str) -> list[tuple[str, nn.Module]]:
        m = self.model
        if stage == "embed":
            names = ["time_guidance_embed", "double_stream_modulation_img", "double_stream_modulation_txt",
                     "single_stream_modulation", "x_embedder", "context_embedder"]
        elif stage == "final":
            names = ["norm_out", "proj_out"]
        else:
            names = [stage]
        return [(n, m.get_submodule(n)) for n in names]

    def materialise(self, stage: str) -> None:
        for prefix, module in self._modules(stage):
            module.to_empty(device=self.device).to(self.dtype)
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
        for _, module in self._modules(stage):
            module.to("meta")

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
        m = self.model
        if stage == "embed":
            timestep = s["timestep"].to(s["x"].dtype) * 1000
            guidance = s.get("guidance")
            if guidance is not None:
                guidance = guidance.to(s["x"].dtype) * 1000
            temb = m.time_guidance_embed(timestep, guidance)
            img_ids = s["img_ids"][0] if s["img_ids"].ndim == 3 else s["img_ids"]
            txt_ids = s["txt_ids"][0] if s["txt_ids"].ndim == 3 else s["txt_ids"]
            img_rope, txt_rope = m.pos_embed(img_ids), m.pos_embed(txt_ids)
            return {
                "temb": temb,
                "mod_img": m.double_stream_modulation_img(temb),
                "mod_txt": m.double_stream_modulation_txt(temb),
                "mod_single": m.single_stream_modulation(temb),
                "img": m.x_embedder(s["x"]),
                "txt": m.context_embedder(s["ctx"]),
                ROPE: (torch.cat([txt_rope[0], img_rope[0]], dim=0), torch.cat([txt_rope[1], img_rope[1]], dim=0)),
                "n_txt": s["ctx"].shape[1],
            }
        shared = {k: s[k] for k in ("temb", "mod_img", "mod_txt", "mod_single", ROPE, "n_txt")}
        if stage.startswith("transformer_blocks."):
            txt, img = m.get_submodule(stage)(
                hidden_states=s["img"], encoder_hidden_states=s["txt"], temb_mod_img=s["mod_img"],
                temb_mod_txt=s["mod_txt"], image_rotary_emb=s[ROPE], joint_attention_kwargs=None)
            return {**shared, "img": img, "txt": txt}
        if stage.startswith("single_transformer_blocks."):
            joint = s["joint"] if "joint" in s else torch.cat([s["txt"], s["img"]], dim=1)
            joint = m.get_submodule(stage)(hidden_states=joint, encoder_hidden_states=None,
                                           temb_mod=s["mod_single"], image_rotary_emb=s[ROPE],
                                           joint_attention_kwargs=None)
            return {**shared, "joint": joint}
        joint = s["joint"] if "joint" in s else torch.cat([s["txt"], s["img"]], dim=1)
        hidden = joint[:, s["n_txt"]:, ...]
        return {"out": m.proj_out(m.norm_out(hidden, s["temb"]))}
