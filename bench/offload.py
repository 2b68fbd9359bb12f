"""Benchmark `port bench` on a synthetic FLUX.2 [klein] pipeline with real klein-4B / klein-9B shapes.

    python bench/offload.py --model klein-4b --device cuda                    # every offload mode, t2i and edit
    python bench/offload.py --model klein-9b --device cuda --offload model,sequential --steps 8
    python bench/offload.py --model tiny                                      # the script itself, on CPU

The folder is built once under --work (default /work/scratch/offload-bench/<model>/) with random weights in bf16:
the real transformer geometry (porting.demo.tiny.REAL_FLUX2), the real text encoder geometry (Qwen3-4B for
klein-4B, Qwen3-8B for klein-9B; flux2-checkpoints.md 8.3), the FLUX.2 VAE defaults, the tiny byte-level tokenizer
(prompts tokenise to bytes, which does not change the compute: the pipeline pads to 512 tokens). The weights are
random, so the images are noise; speed and memory are what a real checkpoint of the same shapes costs. Building
klein-9B needs about 35 GB of disk and of RAM.

It prints `port bench`'s table (peak memory with its counter, it/s, s/image, load time, change against the first
mode) and the SVDQuant klein-9B-kv card's RTX 5090 figures for comparison (community-formats.md section 4). Needs an
accelerator for the offload rows; not part of CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3 = {  # Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json geometry
    "klein-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    "klein-9b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
}
CARD = """SVDQuant klein-9B-kv card, RTX 5090, 1024x1024, 8 steps, bf16 base (the SVDQuant model card on the Hub):
  no offload: OOM | model CPU offload: 20.18 GB, 0.62 it/s (edit), 18.53 GB, 0.83 it/s (t2i)
  sequential offload: 2.55 GB, 0.48 it/s (edit) / 0.62 it/s (t2i)"""


def fill_(module, seed: int) -> None:
    """Cheap random values: a shared random pool, scaled per tensor by 1/sqrt(fan-in); norms at 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(1_000_003, generator=g)
    offset = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            n = p.numel()
            reps = -(-(n + offset) // pool.numel())
            values = pool.repeat(reps)[offset:offset + n].reshape(p.shape) / math.sqrt(p.shape[-1])
            p.copy_(values.to(p.dtype))
            offset = (offset + 7919) % pool.numel()


def build(model: str, folder: Path) -> Path:
    """The synthetic pipeline folder (kept between runs; delete it to rebuild)."""
    from porting.demo.tiny import REAL_FLUX2
    from porting.demo.tinypipe import build_demo_base

    if (folder / "model_index.json").is_file():
        return folder
    if model == "tiny":
        return build_demo_base(folder)
    return build_synthetic(folder, {k: v for k, v in REAL_FLUX2[model].items() if not k.startswith("_")},
                           QWEN3[model])


def build_synthetic(folder: Path, transformer_cfg: dict, text_cfg: dict) -> Path:
    """A Flux2KleinPipeline folder at the given geometry, weights made on the meta device then filled cheaply."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from porting.demo.tinypipe import TINY_SCHEDULER, tiny_tokenizer
    from porting.skeleton import empty_weights, materialise

    started = time.perf_counter()
    with empty_weights():
        transformer = Flux2Transformer2DModel(**transformer_cfg)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(**text_cfg, max_position_embeddings=40960))
    transformer = materialise(transformer, "cpu", torch.bfloat16)
    fill_(transformer, 1)
    text_encoder = materialise(text_encoder, "cpu", torch.bfloat16)  # the rotary tables keep their values
    fill_(text_encoder, 2)
    if text_cfg.get("tie_word_embeddings"):
        text_encoder.tie_weights()  # a skeleton's tied pair are two meta parameters: tie them as a load would
    vae = AutoencoderKLFlux2().to(torch.bfloat16)  # the FLUX.2 VAE defaults; its own random init
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**TINY_SCHEDULER), vae=vae,
                              text_encoder=text_encoder, tokenizer=tiny_tokenizer(), transformer=transformer,
                              is_distilled=True)
    pipe.save_pretrained(folder)
    print(f"built {folder} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return folder


def kv_view(folder: Path) -> Path:
    """The same components declared as a Flux2KleinKVPipeline (a KV repo differs only in model_index.json,
    flux2-checkpoints.md 8.2), in a sibling folder of symbolic links."""
    kv = folder.with_name(folder.name + "-kv")
    if not kv.exists():
        kv.mkdir()
        for item in folder.iterdir():
            if item.name != "model_index.json":
                (kv / item.name).symlink_to(item.resolve())
        index = json.loads((folder / "model_index.json").read_text())
        index["_class_name"] = "Flux2KleinKVPipeline"
        index.pop("is_distilled", None)
        (kv / "model_index.json").write_text(json.dumps(index, indent=2))
    return kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "klein-4b", "klein-9b"], default="klein-4b")
    ap.add_argument("--kv", action="store_true", help="declare Flux2KleinKVPipeline (the klein-9B-kv card's "
                    "pipeline; its edit path uses the reference KV cache)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--offload", default="none,model,sequential,group")
    ap.add_argument("--task", default="t2i,edit")
    ap.add_argument("--size", default=None, help="default 1024 (32 for tiny)")
    ap.add_argument("--steps", type=int, default=8, help="the card's 8 steps")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/work/scratch/offload-bench"))
    args = ap.parse_args()
    folder = build(args.model, args.work / args.model)
    if args.kv:
        folder = kv_view(folder)
    size = args.size or ("32" if args.model == "tiny" else "1024")
    if args.model == "tiny" and args.device == "cuda":
        args.device = "cpu"
    out = args.work / "results" / f"{args.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "porting", "bench", str(folder), "--device", args.device, "--offload", args.offload,
           "--task", args.task, "--size", size, "--steps", str(args.steps), "--runs", str(args.runs), "--warmup",
           str(args.warmup), "--out", str(out)]
    print("$", " ".join(cmd), file=sys.stderr)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    code = subprocess.call(cmd, env=env)
    if code == 0:
        doc = json.loads((out / "bench.json").read_text())
        print((out / "bench.md").read_text())
        print(f"({doc['device_name']}, torch {doc['torch']})")
        print(CARD)
    sys.exit(code)


if __name__ == "__main__":
    main()
