"""A tiny offline port (base repository, fine-tune, converted transformer, report fixtures) shared by the publish and
generate tests. Built once per test session under pytest's base temp folder; both modules reuse the same files."""

from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint  # noqa: E402
from porting.demo.tinypipe import build_demo_base, tiny_components  # noqa: E402
from porting.engine.convert import convert  # noqa: E402

OTHER_WEIGHTS = "0" * 64


@lru_cache(maxsize=None)
def tiny_transformer_config() -> str:
    """config.json as port convert writes it for TINY_FLUX2 (what the tiny transformers here were validated with)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = write_random_checkpoint(Path(tmp) / "t.safetensors", TINY_FLUX2, seed=0)
        convert(src, Path(tmp) / "out", strict=True)
        return (Path(tmp) / "out" / "config.json").read_text()


def report_doc(weights: str, verdict: str = "pass", config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A report.json as port validate writes it (the fields publish relies on)."""
    config = config if config is not None else json.loads(tiny_transformer_config())
    return {
        "model": {"config": {k: v for k, v in config.items() if not k.startswith("_")}},
        "tool": "flux-port", "version": "0.1.0", "weights_sha256": weights, "verdict": verdict, "device": "cpu",
        "dtype": "bf16", "reference": "cpu", "golden_dtype": "fp32",
        "inputs": {"resolution": 64, "text_len": 16, "timesteps": [1.0, 0.5], "seeds": [0]},
        "output": {"cosine": 0.99991, "rel_l2": 0.0123, "max_abs": 0.05, "mean_abs": 0.004},
        "rule": {"max_ratio": 2.0},
        "summary": [{"name": "t=1.0", "device_error": 0.0123, "intrinsic_error": 0.0119, "ratio": 1.03},
                    {"name": "t=0.5", "device_error": 0.0131, "intrinsic_error": 0.0122, "ratio": 1.07}],
        "blame": None if verdict == "pass" else {"block": "transformer_blocks.0", "original": "double_blocks.0"},
    }


def write_report(folder: Path, weights: str, verdict: str = "pass", config: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report_doc(weights, verdict, config), indent=2))
    (folder / "report.md").write_text(f"# validation report\n\nverdict: {verdict}\n")
    return folder / "report.json"


def build_tiny_port(root: Path) -> dict[str, Any]:
    """base/, finetune/, transformer/ (converted --strict), reports/{pass,fail,other}/report.json under `root`."""
    done = root / "done.json"
    if done.is_file():
        return {k: Path(v) if k != "weights" else v for k, v in json.loads(done.read_text()).items()}
    root.mkdir(parents=True, exist_ok=True)
    base = build_demo_base(root / "base")
    src = write_random_checkpoint(root / "finetune" / "tiny-klein-ft.safetensors", TINY_FLUX2, seed=1)
    result = convert(src, root / "transformer", strict=True)
    weights = result.weights_sha256
    paths = {
        "root": root, "base": base, "source": src, "transformer": root / "transformer", "weights": weights,
        "pass": write_report(root / "reports" / "pass", weights),
        "fail": write_report(root / "reports" / "fail", weights, verdict="fail"),
        "other": write_report(root / "reports" / "other", OTHER_WEIGHTS),
    }
    done.write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    return paths


def in_memory_image(pipeline_cls: type, transformer_dir: Path, seed: int = 7, **call: Any) -> np.ndarray:
    """The same pipeline assembled in memory: the tiny components rebuilt from their seed, the transformer from
    the converted folder (not from the published one)."""
    from diffusers import Flux2Transformer2DModel

    comps = tiny_components(seed=0)
    comps["transformer"] = Flux2Transformer2DModel.from_pretrained(transformer_dir, dtype=torch.float32)
    pipe = pipeline_cls(**comps) if pipeline_cls.__name__.endswith("KVPipeline") else pipeline_cls(
        **comps, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    return np.array(pipe(**call, generator=torch.Generator().manual_seed(seed)).images[0])
