"""`--text-encoder FILE`: a 4-bit text encoder (Nunchaku's AWQ W4A16 Qwen3 or T5) run packed in a pipeline in place
of the folder's own, and the error it puts into the prompt embeddings against the folder's bf16 encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from porting._files import read_config
from porting.errors import InputError


def open_swap(folder: Path, file: Path) -> Any:
    """The opened 4-bit text encoder `file`, refused (exit 2, before anything loads) unless it is one and fits the
    pipeline `folder`: the slot its architecture fills exists there with the same widths."""
    from porting.inputs import open_source

    source = open_source(file)
    if source.kind != "text_encoder":
        raise InputError(f"--text-encoder {file}: not a text encoder file (Qwen3Model or T5EncoderModel names).",
                         hint="Give the 4-bit text encoder file (e.g. svdq-int4-Qwen3-text-Nunchaku.safetensors).")
    encoder = source.text_encoder
    if not encoder.quantized:
        raise InputError(f"--text-encoder {file}: a bf16 text encoder; --text-encoder runs a 4-bit one packed.",
                         hint=f"Make it 4-bit first: port convert {file} --quantize awq-int4 --out DIR")
    slot = encoder.architecture.slot
    own = Path(folder) / slot / "config.json"
    if not own.is_file():
        raise InputError(f"--text-encoder {file}: a {encoder.architecture.label}, but the pipeline {folder} has no "
                         f"{slot}/ to put it in.", hint=f"Use it with {encoder.architecture.pipelines}.")
    config = read_config(own, f"the pipeline's {slot} config")
    for name in encoder.architecture.config_fields:
        if name in config and name in encoder.config and config[name] != encoder.config[name]:
            raise InputError(f"--text-encoder {file}: {name} is {encoder.config[name]!r}, the pipeline's {slot} has "
                             f"{config[name]!r}; its transformer cannot read those features.",
                             hint="Give the 4-bit encoder of the same model (the same size).")
    return source


def load_swap(source: Any, device: Any, dtype: Any) -> tuple[str, Any]:
    """(the pipeline slot, the packed encoder on `device`)."""
    from porting.runtime.awq_text import load_packed_text_encoder

    return source.text_encoder.architecture.slot, load_packed_text_encoder(source, device, dtype)


def own_encoder(folder: Path, slot: str, dtype: Any) -> Any:
    """The pipeline folder's own encoder for `slot`, loaded alone (its class from model_index.json)."""
    import warnings

    import transformers

    from porting._files import read_json_object

    index = read_json_object(Path(folder) / "model_index.json", "a diffusers pipeline folder has one at its root")
    cls = getattr(transformers, index[slot][1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(Path(folder) / slot, dtype=dtype).eval()


def embedding_error(pipe: Any, slot: str, reference: Any, prompts: Sequence[str]) -> float:
    """Relative L2 distance of the prompt embeddings the pipeline's encoder in `slot` gives from those `reference`
    (another encoder for the slot, e.g. the folder's own bf16 one) gives, over `prompts`; the pipeline keeps its
    encoder."""
    import torch

    own = getattr(pipe, slot)
    with torch.no_grad():
        got = [_embeds(pipe, p) for p in prompts]
        setattr(pipe, slot, reference.to(pipe._execution_device))
        try:
            want = [_embeds(pipe, p) for p in prompts]
        finally:
            setattr(pipe, slot, own)
    num = sum(float((g.float() - w.float()).norm() ** 2) for g, w in zip(got, want))
    den = sum(float(w.float().norm() ** 2) for w in want)
    return (num / max(den, 1e-30)) ** 0.5


def _embeds(pipe: Any, prompt: str) -> Any:
    out = pipe.encode_prompt(prompt=prompt, device=pipe._execution_device)
    return out[0]


__all__ = ["open_swap", "load_swap", "own_encoder", "embedding_error"]
