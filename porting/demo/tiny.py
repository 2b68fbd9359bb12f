"""Tiny random checkpoints in the real FLUX architectures, for the demo, tests and benchmarks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from porting.families import get_family
from porting.families.flux2 import FAMILY as FLUX2
from porting.families.mapping import Naming
from porting.skeleton import empty_weights
from porting.tensors.dtypes import ST_TO_TORCH
from porting.tensors.writer import Entry, write_shards

TINY_FLUX2: Mapping[str, Any] = FLUX2.tiny_config
REAL_FLUX2: Mapping[str, Mapping[str, Any]] = FLUX2.real_configs


def model_shapes(config: Mapping[str, Any], naming: Naming = "original", table: str = "flux2") -> dict[str, tuple]:
    return get_family(table).expected_shapes(config, naming)


def random_tensor(key: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Weights at a scale that keeps a deep random model's activations finite and non-trivial."""
    if len(shape) == 1:  # RMSNorm scales and biases
        base = 1.0 if key.endswith(("scale", "norm_q.weight", "norm_k.weight", "norm_added_q.weight",
                                    "norm_added_k.weight")) else 0.0
        return base + 0.1 * torch.randn(shape, generator=generator)
    fan_in = shape[-1]
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


POOL_SIZE = 1_000_003  # prime and larger than any row count, so the rows of a tiled tensor all differ


def tiled_tensor(shape: tuple[int, ...], pool: torch.Tensor, offset: int) -> torch.Tensor:
    """A tensor cut from a repeated random pool: memcpy speed instead of a random draw per element."""
    n = math.prod(shape)
    reps = -(-(n + offset) // pool.numel())
    return pool.repeat(reps)[offset:offset + n].reshape(shape).clone()


def write_random_checkpoint(path: str | Path, config: Mapping[str, Any], naming: Naming = "original",
                            dtype: str = "BF16", seed: int = 0, table: str = "flux2", prefix: str = "",
                            max_shard_bytes: int | None = None, fill: str = "random") -> Path:
    """Write a random checkpoint of `config` in `naming`, streamed so even real sizes fit in little memory.

    `path` is a `.safetensors` file (single file) or a folder (shards with an index when `max_shard_bytes`).
    `fill="tiled"` cuts every tensor from one small random pool at a tensor-specific offset (for benchmarks at real
    size, where drawing billions of random numbers would take longer than the conversion being measured).
    """
    path = Path(path)
    shapes = model_shapes(config, naming, table)
    gen = torch.Generator().manual_seed(seed)
    entries = [Entry(prefix + k, s, dtype) for k, s in shapes.items()]
    if fill == "random":
        tensors = (random_tensor(e.key, e.shape, gen).to(ST_TO_TORCH[dtype]) for e in entries)
    elif fill == "tiled":
        pool = (0.02 * torch.randn(POOL_SIZE, generator=gen)).to(ST_TO_TORCH[dtype])
        tensors = (tiled_tensor(e.shape, pool, (7919 * i) % POOL_SIZE) for i, e in enumerate(entries))
    else:
        raise ValueError(f"fill must be 'random' or 'tiled', not {fill!r}")
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        write_shards(path.parent, path.name[: -len(".safetensors")], entries, tensors, 2**62,
                     metadata={"format": "pt"})
    else:
        path.mkdir(parents=True, exist_ok=True)
        write_shards(path, "model", entries, tensors, max_shard_bytes or 2**62, metadata={"format": "pt"})
    return path


# Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json geometry (klein-4B's and klein-9B's text encoders; as bench/offload.py)
REAL_QWEN3: Mapping[str, Mapping[str, Any]] = {
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
                 "max_position_embeddings": 40960},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960},
}


def write_random_text_encoder(folder: str | Path, config: Mapping[str, Any], seed: int = 0, dtype: str = "BF16",
                              max_shard_bytes: int = 5 * 10**9) -> Path:
    """A Qwen3ForCausalLM folder (config.json, sharded safetensors with an index) of `config`'s geometry, written
    one tensor at a time (`fill="tiled"` values; norms at 1), keys as transformers saves them: `lm_head.weight` only
    when the embeddings are not tied (Qwen3-4B stores no lm_head, Qwen3-8B stores both)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3Config(**config, architectures=["Qwen3ForCausalLM"])
    with empty_weights():
        model = Qwen3ForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    entries = [Entry(k, s, dtype) for k, s in shapes.items()]
    gen = torch.Generator().manual_seed(seed)
    pool = (0.02 * torch.randn(POOL_SIZE, generator=gen)).to(ST_TO_TORCH[dtype])
    tensors = (torch.ones(e.shape, dtype=ST_TO_TORCH[dtype]) if "norm" in e.key else
               tiled_tensor(e.shape, pool, (7919 * i) % POOL_SIZE) for i, e in enumerate(entries))
    write_shards(folder, "model", entries, tensors, max_shard_bytes, metadata={"format": "pt"})
    cfg.to_json_file(str(folder / "config.json"))
    return folder
