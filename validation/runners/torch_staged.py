"""The torch runner: a diffusers model run stage by stage (`validation.staged.StagedModel`), on any torch device."""

from __future__ import annotations

from typing import Any

import torch

from porting.devices import device_facts
from validation.staged import StagedModel
from validation.weights import WeightSource, WeightTransform


class TorchStagedRunner(StagedModel):
    runtime = "torch"
    localises = True
    localisation_note = ""

    def facts(self) -> dict[str, Any]:
        return device_facts(self.device)


def torch_runner(source: WeightSource, device: torch.device, dtype: torch.dtype,
                 weight_transform: WeightTransform | None = None,
                 emulate: torch.dtype | None = None, packed: Any = None) -> TorchStagedRunner:
    return TorchStagedRunner(source, device, dtype, weight_transform, emulate, packed)
