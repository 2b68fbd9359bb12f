"""Quantized single-file outputs for runtimes that load them directly (ComfyUI, ComfyUI-GGUF, llama.cpp-style).

Each module writes one layout from tensors in original (BFL) naming, streaming: the header first from known shapes,
then one tensor at a time. Which linears are quantized follows city96's rule for FLUX: 2-D weights, except the
embedders and the final layer (`img_in`, `txt_in`, `time_in`, `guidance_in`, `vector_in`, `final_layer`), whose
input dimension fits the block size; everything else keeps its precision (1-D tensors in float32 for GGUF).
"""

from __future__ import annotations

KEEP_PREFIXES = ("img_in.", "txt_in.", "time_in.", "guidance_in.", "vector_in.", "final_layer.")


def quantizable(key: str, shape: tuple[int, ...], block: int) -> bool:
    return (len(shape) == 2 and key.endswith(".weight") and not key.startswith(KEEP_PREFIXES)
            and shape[1] % block == 0 and shape[0] * shape[1] > 1024)
