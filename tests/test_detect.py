"""Detection from headers: every storage layout and naming is recognised, and `--config` is honoured or refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from safetensors.torch import save_file

from porting.engine.convert import convert

from .helpers import (
    TINY1_SCHNELL,
    TINY2,
    assert_same_tensors,
    leftovers,
    load_folder,
    reference_model,
    run_port,
    save_state,
)

TINY2_CONFIG = {
    "patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 2, "num_single_layers": 2,
    "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 48, "guidance_embeds": False,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [8, 8, 8, 8], "rope_theta": 2000,
    "eps": 1e-6,
}
# black-forest-labs/FLUX.2-klein-base-4B transformer/config.json (flux2-checkpoints.md section 2.2)
KLEIN_4B_CONFIG = {
    "_class_name": "Flux2Transformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32],
    "eps": 1e-06, "guidance_embeds": False, "in_channels": 128, "joint_attention_dim": 7680, "mlp_ratio": 3.0,
    "num_attention_heads": 24, "num_layers": 5, "num_single_layers": 20, "out_channels": None, "patch_size": 1,
    "rope_theta": 2000, "timestep_guidance_channels": 256,
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One tiny FLUX.2 model stored five ways, plus the canonical tensors in each naming."""
    root = tmp_path_factory.mktemp("layouts")
    original = {k: v.to(torch.bfloat16) for k, v in reference_model(TINY2, seed=11).state_dict().items()}
    paths = {"original file": save_state(root / "bfl.safetensors", original)}
    paths["prefixed original file"] = save_state(root / "comfy.safetensors", original, prefix="model.diffusion_model.")
    convert(paths["original file"], root / "diffusers-folder", strict=True)
    paths["diffusers folder"] = root / "diffusers-folder"
    diffusers = load_folder(root / "diffusers-folder")
    paths["diffusers file"] = root / "diffusers-named.safetensors"
    shutil.copy(root / "diffusers-folder" / "diffusion_pytorch_model.safetensors", paths["diffusers file"])
    # original naming in three shards with a hand-written standard index
    sharded = root / "sharded"
    sharded.mkdir()
    keys = list(original)
    weight_map = {}
    for i, part in enumerate((keys[:10], keys[10:25], keys[25:])):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: original[k] for k in part}, str(sharded / name))
        weight_map.update(dict.fromkeys(part, name))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    paths["sharded original folder"] = sharded
    return paths, {"original": original, "diffusers": diffusers}


EXPECT = {  # layout -> (naming, prefix)
    "original file": ("original", ""),
    "prefixed original file": ("original", "model.diffusion_model."),
    "diffusers file": ("diffusers", ""),
    "sharded original folder": ("original", ""),
    "diffusers folder": ("diffusers", ""),
}


@pytest.mark.parametrize("layout", list(EXPECT))
def test_inspect_recognises_layout(layouts, capsys, layout):
    paths, canonical = layouts
    run = run_port(capsys, "inspect", paths[layout], "--json")
    assert run.code == 0, run.err
    info = json.loads(run.out)
    naming, prefix = EXPECT[layout]
    assert (info["family"], info["naming"], info["prefix"]) == ("flux2", naming, prefix)
    assert info["tensors"] == len(canonical[naming])
    assert info["variant"] == "custom flux2"  # tiny: none of the published geometries
    assert info["config"] == TINY2_CONFIG
    if layout == "sharded original folder":
        assert len(info["files"]) == 3


@pytest.mark.parametrize("layout", list(EXPECT))
def test_convert_from_every_layout_gives_the_canonical_tensors(layouts, tmp_path, capsys, layout):
    paths, canonical = layouts
    naming = EXPECT[layout][0]
    target = "original" if naming == "diffusers" else "diffusers"
    run = run_port(capsys, "convert", paths[layout], "--out", tmp_path / "out", "--to", target, "--strict", "-q")
    assert run.code == 0, run.err
    assert_same_tensors(load_folder(tmp_path / "out"), canonical[target])
    manifest = json.loads((tmp_path / "out" / "flux-port.json").read_text())
    assert manifest["source_naming"] == (f"original (prefix {EXPECT[layout][1]!r})" if EXPECT[layout][1] else naming)


@pytest.mark.parametrize("naming", ["original", "diffusers"])
def test_flux1_is_recognised_in_both_namings(tmp_path, capsys, naming):
    src = save_state(tmp_path / "schnell.safetensors", reference_model(TINY1_SCHNELL).state_dict())
    if naming == "diffusers":
        convert(src, tmp_path / "d", strict=True)
        src = tmp_path / "d"
    info = json.loads(run_port(capsys, "inspect", src, "--json").out)
    assert (info["family"], info["naming"], info["diffusers_class"]) == ("flux1", naming, "FluxTransformer2DModel")
    assert info["config"]["pooled_projection_dim"] == 24 and info["config"]["guidance_embeds"] is False
    assert info["config"]["axes_dims_rope"] == [16, 56, 56]


def _base(tmp_path: Path, config: dict) -> Path:
    """A base model folder laid out like a diffusers pipeline: <base>/transformer/config.json."""
    (tmp_path / "base" / "transformer").mkdir(parents=True)
    (tmp_path / "base" / "transformer" / "config.json").write_text(json.dumps(config))
    return tmp_path / "base"


def test_config_base_is_carried_into_output(layouts, tmp_path, capsys):
    """Fields that shapes cannot tell (RoPE axes and theta) come from the base, not from the defaults."""
    base = _base(tmp_path, {"_class_name": "Flux2Transformer2DModel", **TINY2_CONFIG,
                            "axes_dims_rope": [4, 12, 8, 8], "rope_theta": 1000})
    run = run_port(capsys, "convert", layouts[0]["original file"], "--out", tmp_path / "out", "--config", base, "-q")
    assert run.code == 0, run.err
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["axes_dims_rope"] == [4, 12, 8, 8] and written["rope_theta"] == 1000
    assert written["_class_name"] == "Flux2Transformer2DModel"
    model = Flux2Transformer2DModel.from_pretrained(tmp_path / "out")
    assert list(model.config.axes_dims_rope) == [4, 12, 8, 8]
    # a config.json file given directly works the same
    run = run_port(capsys, "convert", layouts[0]["original file"], "--out", tmp_path / "out2", "--config",
                   base / "transformer" / "config.json", "-q")
    assert run.code == 0 and json.loads((tmp_path / "out2" / "config.json").read_text()) == written


@pytest.mark.parametrize("base_config, fields", [
    # a klein-4B-architecture tiny fine-tune against the real klein-4B base: every size differs
    (KLEIN_4B_CONFIG, ["num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                       "joint_attention_dim", "in_channels"]),
    # one field off: the base has a third double block
    ({"_class_name": "Flux2Transformer2DModel", **TINY2_CONFIG, "num_layers": 3}, ["num_layers"]),
    # a guidance-distilled base (dev-like) for a klein-like checkpoint
    ({**TINY2_CONFIG, "guidance_embeds": True}, ["guidance_embeds"]),
])
def test_finetune_that_does_not_fit_its_base_is_refused(layouts, tmp_path, capsys, base_config, fields):
    out = tmp_path / "out"
    run = run_port(capsys, "convert", layouts[0]["original file"], "--out", out, "--config",
                   _base(tmp_path, base_config), "--strict")
    assert run.code == 1
    assert f"does not fit the base config ({len(fields)} field(s) differ)" in run.err
    named = [line.split(":")[0].strip() for line in run.err.splitlines() if ": base " in line]
    assert sorted(named) == sorted(fields)
    assert leftovers(out) == []


def test_base_config_for_another_class_is_refused(layouts, tmp_path, capsys):
    base = _base(tmp_path, {"_class_name": "FluxTransformer2DModel", "num_layers": 19})
    run = run_port(capsys, "convert", layouts[0]["original file"], "--out", tmp_path / "out", "--config", base)
    assert run.code == 1
    assert "base config is for FluxTransformer2DModel" in run.err and "Flux2Transformer2DModel" in run.err
    assert leftovers(tmp_path / "out") == []


def test_missing_base_config_is_a_clear_error(layouts, tmp_path, capsys):
    run = run_port(capsys, "convert", layouts[0]["original file"], "--out", tmp_path / "out", "--config",
                   tmp_path / "nowhere")
    assert run.code == 2 and "no transformer/config.json or config.json found" in run.err
    assert leftovers(tmp_path / "out") == []
