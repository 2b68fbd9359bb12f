"""`port publish --adapter DIR`: a converted adapter travels next to the pipeline and the card says how to load it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from porting.adapters.convert import convert_adapter
from porting.demo.tiny import TINY_FLUX2, model_shapes

from .helpers import run_port
from .lorakit import BY_NAME, make_parts, write_adapter
from .tinyport import build_tiny_port


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    return build_tiny_port(tmp_path_factory.getbasetemp() / "tiny-port")


def tiny_adapter(folder: Path, seed: int = 0, width_factor: int = 1) -> Path:
    """A kohya LoRA for the tiny port's transformer (TINY_FLUX2 shapes), converted by port convert."""
    shapes = {k[: -len(".weight")]: (s[0] * width_factor, s[1] * width_factor)
              for k, s in model_shapes(TINY_FLUX2).items() if k.endswith(".weight")}
    parts = make_parts(shapes, ["double_blocks.0.img_attn.qkv", "final_layer.adaLN_modulation.1"], "lora", seed=seed,
                       alpha=1.0)
    src = write_adapter(folder.parent / f"{folder.name}-kohya.safetensors", BY_NAME["kohya"], parts)
    convert_adapter(src, folder)
    return folder


def test_publish_carries_a_converted_adapter(port, tmp_path, capsys):
    from diffusers import Flux2KleinPipeline
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapter = tiny_adapter(tmp_path / "style")
    out = tmp_path / "published"
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"], "--report",
                   port["pass"], "--out", out, "--adapter", adapter, "--base-model",
                   "black-forest-labs/FLUX.2-klein-4B", "--quiet")
    assert run.code == 0, run.err
    file = out / "adapters" / "style" / "pytorch_lora_weights.safetensors"
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["files"]["adapters/style/pytorch_lora_weights.safetensors"]
    assert entry["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    card = (out / "README.md").read_text()
    assert '## Adapters' in card and 'subfolder="adapters/style"' in card and "kohya" in card
    # what the card says works: the published pipeline loads the adapter, every module of it
    pipe = Flux2KleinPipeline.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    pipe.load_lora_weights(str(out), subfolder="adapters/style", adapter_name="style")
    wrapped = {n for n, m in pipe.transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    assert wrapped == {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                       "transformer_blocks.0.attn.to_v", "norm_out.linear"}


def test_publish_refuses_an_adapter_for_another_transformer(port, tmp_path, capsys):
    adapter = tiny_adapter(tmp_path / "wide", width_factor=2)
    out = tmp_path / "published"
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"], "--report",
                   port["pass"], "--out", out, "--adapter", adapter)
    assert run.code == 2 and not out.exists()
    assert "does not fit the transformer" in run.msg
