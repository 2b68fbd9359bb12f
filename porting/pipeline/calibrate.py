"""`--calibrate BASE`: the per-channel input maxima of every block linear, from the bf16 model run on a few prompts.

The transformer being quantized is swapped into BASE's pipeline (its text encoder, VAE and scheduler), run once per
prompt for a few steps on `device` in bf16, and a forward pre-hook on each linear of the transformer blocks keeps
max |x| per input channel over every token, step and prompt. `svdq_quantize.smoothing` then uses SmoothQuant's rule
with these maxima instead of assuming them equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

PROMPTS = ("a photograph of a red fox standing in fresh snow, morning light",
           "a watercolor painting of a lighthouse on a cliff at dusk",
           "a close-up studio portrait of an old fisherman with a grey beard",
           "a neon-lit city street at night in the rain, reflections on the asphalt")
STEPS = 4
BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


def check_calibrate_base(base: Path, transformer: Path) -> None:
    """`--calibrate BASE` is a diffusers pipeline folder whose text encoder and VAE feed `transformer`: refused by
    name (exit 2) before anything is written or loaded."""
    from porting._files import read_json_object
    from porting.errors import InputError
    from porting.pipeline.pipeload import check_swap_fits

    hint = ("Give --calibrate the diffusers pipeline folder of the model's own family (model_index.json, text "
            "encoder, VAE), e.g. the base the fine-tune was trained on; or leave it out for data-free smoothing.")
    if not base.is_dir():
        raise InputError(f"--calibrate {base}: {'not a folder' if base.exists() else 'no such folder'}; it runs the "
                         "model in a pipeline's text encoder and VAE.", hint=hint)
    if not (base / "model_index.json").is_file():
        raise InputError(f"--calibrate {base}: no model_index.json, so not a diffusers pipeline folder.", hint=hint)
    read_json_object(base / "model_index.json", "a diffusers pipeline folder has one at its root")
    check_swap_fits(base, transformer, option="--calibrate")


def input_maxima(base: Path, transformer: Path, device: str = "cpu", prompts: Sequence[str] = PROMPTS,
                 steps: int = STEPS, size: int | None = None) -> dict[str, torch.Tensor]:
    """Diffusers module name -> float32 max |input| per input channel, over all prompts and steps."""
    from porting.devices import resolve_device
    from porting.pipeline.generate import default_size
    from porting.pipeline.pipeload import load

    check_calibrate_base(base, transformer)
    where = resolve_device(device)
    pipe = load(base, where, torch.bfloat16, transformer=transformer)
    side = size or min(default_size(where, base), 512)
    maxima: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def keep(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach()
            m = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float().cpu()
            maxima[name] = m if name not in maxima else torch.maximum(maxima[name], m)
        return keep

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in pipe.transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith(BLOCKS)]
    try:
        with torch.no_grad():
            for i, prompt in enumerate(prompts):
                pipe(prompt=prompt, num_inference_steps=steps, height=side, width=side, output_type="latent",
                     generator=torch.Generator(device="cpu").manual_seed(i))
    finally:
        for h in handles:
            h.remove()
    return maxima



@dataclass(frozen=True)
class Calibration:
    """`--calibrate BASE --device D` as `engine.svdq_convert.convert_svdquant` takes it (its `Calibrator`), so the
    engine runs no pipeline of its own."""

    base: Path
    device: str = "cpu"

    def check(self, transformer: Path) -> None:
        check_calibrate_base(self.base, transformer)

    def maxima(self, transformer: Path) -> dict[str, torch.Tensor]:
        return input_maxima(self.base, transformer, self.device)

    def describe(self) -> str:
        return f"{len(PROMPTS)} prompts x {STEPS} steps in {self.base.name} on {self.device}"


__all__ = ["PROMPTS", "STEPS", "Calibration", "check_calibrate_base", "input_maxima"]
