"""ComfyUI's legacy "scaled fp8" file: what `comfy/utils.py` `convert_old_quants` reads.

Keys carry the `model.diffusion_model.` prefix; each quantized linear is an fp8 (e4m3fn) `weight` and an fp32
scalar `scale_weight` (amax / 448, so the largest value maps to the top of the fp8 range); a `scaled_fp8` marker
tensor (empty, float8_e4m3fn) declares the layout. Other tensors keep the output dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch

from porting.finite import check_tensor

from ..writer import Entry, write_shards
from . import quantizable

NAME = "ComfyUI scaled fp8"
PREFIX = "model.diffusion_model."
FP8_MAX = 448.0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def write(path: Path, specs: list[tuple[str, tuple[int, ...]]], tensors: Iterable[torch.Tensor], plain: str
          ) -> dict[str, str]:
    """Write `tensors` (in `specs` order, original naming) to `path`; returns key -> stored kind."""
    kinds = {k: ("F8_E4M3" if quantizable(k, s, 1) else plain) for k, s in specs}
    entries: list[Entry] = []
    for key, shape in specs:
        entries.append(Entry(PREFIX + key, shape, kinds[key]))
        if kinds[key] == "F8_E4M3":
            entries.append(Entry(PREFIX + key[: -len("weight")] + "scale_weight", (), "F32"))
    entries.append(Entry(PREFIX + "scaled_fp8", (0,), "F8_E4M3"))

    def items() -> Iterator[torch.Tensor]:
        from ..dtypes import ST_TO_TORCH

        for (key, _), t in zip(specs, tensors):
            if kinds[key] == "F8_E4M3":
                yield from quantize(t)
            else:
                check_tensor(t, f"layer {key}", None, into=ST_TO_TORCH[plain])
                yield t.to(ST_TO_TORCH[plain]).contiguous()
        yield torch.empty(0, dtype=torch.float8_e4m3fn)

    write_shards(path.parent, path.name[: -len(".safetensors")], entries, items(), max_shard_bytes=2**62,
                 metadata={"format": "pt"})
    return {k: ("float8_e4m3fn x scale_weight" if v == "F8_E4M3" else v) for k, v in kinds.items()}
