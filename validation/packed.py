"""An SVDQuant transformer validated as it runs packed: the staged model's quantized linears become `SvdqLinear`s.

`port validate SVDQ_FILE --svdq-compute w4a4` gives the intrinsic run (reference device) and the device run the
kernel's arithmetic (4-bit activations, `porting.runtime`), while the golden keeps the float32 run of the dequantized
weights. The verdict is then the device's packed run against the CPU's packed run (is the port right on this
device), and the per-block errors against the golden show where the 4-bit activation error sits.
"""

from __future__ import annotations

import torch
from torch import nn

from porting.errors import InputError
from porting.runtime.svdq_linear import SvdqLinear
from porting.tensors.quant.svdq.decode import SvdqDecoder
from porting.tensors.quant.svdq.reader import svdq_info

from .weights import WeightSource


class PackedLinears:
    """Builds the packed linears of one stage's modules, on the run's device, each time the stage is materialised."""

    def __init__(self, source: WeightSource, compute: str = "w4a4") -> None:
        info = svdq_info(source.ckpt)
        if info is None:
            raise InputError(f"{source.path}: --svdq-compute applies to a Nunchaku SVDQuant file; this is not one.")
        self.info, self.compute = info, compute
        self.decoder = SvdqDecoder(info)
        self.modules = [k[: -len(".weight")] for k, t in info.targets.items() if t.role == "weight"]

    def install(self, prefix: str, module: nn.Module, device: torch.device, act_dtype: torch.dtype | None) -> None:
        """Replace the quantized linears under `prefix` (a stage module of the model) by packed ones on `device`."""
        for name in self.modules:
            if name != prefix and not name.startswith(prefix + "."):
                continue
            bias = self.info.targets.get(name + ".bias")
            linear = SvdqLinear.from_target(self.info.targets[name + ".weight"], bias, self.decoder, self.compute)
            linear.act_dtype = act_dtype
            module.set_submodule(name[len(prefix) + 1:], linear.to(device))

    def release(self, prefix: str, module: nn.Module) -> None:
        """Drop the packed linears `install` put under `prefix` to the meta device: their weights are buffers, which
        `porting.skeleton.release` keeps (the next `install` builds them again)."""
        for name in self.modules:
            if name == prefix or name.startswith(prefix + "."):
                module.get_submodule(name[len(prefix) + 1:]).to("meta")


__all__ = ["PackedLinears"]
