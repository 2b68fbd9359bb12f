"""Adapters that must not be merged or converted silently: every refusal names the key, writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from porting.adapters.merge import parse_strength

from .helpers import TINY2, leftovers, reference_model, run_port, save_state
from .lorakit import BY_NAME, Part, adapter_for, write_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-refusals")
    state = reference_model(TINY2, seed=6).state_dict()
    return {"file": save_state(root / "base.safetensors", state), "state": state}


def _kohya_with(tmp_path: Path, base, extra: dict[str, torch.Tensor]) -> Path:
    path, _ = adapter_for(tmp_path / "good.safetensors", BY_NAME["kohya"], base["state"], seed=1)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(tmp_path / "adapter.safetensors"))
    return tmp_path / "adapter.safetensors"


@pytest.mark.parametrize("extra, why", [
    # block 5 does not exist in a 2-block base
    ({"lora_unet_double_blocks_5_img_attn_qkv.lora_down.weight": torch.zeros(2, 64),
      "lora_unet_double_blocks_5_img_attn_qkv.lora_up.weight": torch.zeros(192, 2)}, "the base has no tensor"),
    # a text-encoder LoRA key cannot land on a transformer
    ({"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(2, 8)}, "not a flux2 module"),
    # FLUX.2 has no biases
    ({"diffusion_model.img_in.diff_b": torch.zeros(64)}, "has no bias"),
    # wrong size for this base (a LoRA for a wider model)
    ({"lora_unet_double_blocks_1_img_attn_proj.lora_down.weight": torch.zeros(2, 96),
      "lora_unet_double_blocks_1_img_attn_proj.lora_up.weight": torch.zeros(64, 2)}, "does not fit"),
    # half a LoRA pair
    ({"lora_unet_double_blocks_1_img_attn_proj.lora_down.weight": torch.zeros(2, 64)}, "lack up"),
], ids=["missing block", "text encoder", "bias diff", "wrong shape", "no up factor"])
def test_merge_refuses_leftover_keys_by_name(base, tmp_path, capsys, extra, why):
    adapter = _kohya_with(tmp_path, base, extra)
    out = tmp_path / "merged"
    run = run_port(capsys, "merge", base["file"], adapter, "--out", out)
    assert run.code == 1, run.err
    assert leftovers(out) == [], "nothing written"
    first = sorted(extra)[0]
    assert first in run.msg and why in run.msg
    assert "nothing was written" in run.msg
    run = run_port(capsys, "merge", base["file"], adapter, "--out", out, "--json")
    doc = json.loads(run.out)
    assert run.code == 1 and doc["exit_code"] == 1
    assert any(first in row["keys"] for row in doc["report"]["leftovers"])


def test_convert_refuses_unreadable_keys_by_name(base, tmp_path, capsys):
    adapter = _kohya_with(tmp_path, base, {"lora_unet_double_blocks_0_img_attn_qkv.dora_scale": torch.ones(192)})
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "lora")
    assert run.code == 2 and not (tmp_path / "lora").exists()
    assert "lora_unet_double_blocks_0_img_attn_qkv.dora_scale" in run.msg and "DoRA" in run.msg


def test_loha_for_diffusers_needs_materialise(base, tmp_path, capsys):
    adapter, _ = adapter_for(tmp_path / "loha.safetensors", BY_NAME["kohya-loha"], base["state"],
                             modules=["img_in"])
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "lora")
    assert run.code == 2 and not (tmp_path / "lora").exists()
    assert "diffusers loads LoRA and LoKr adapters only" in run.msg and "--materialise" in run.msg
    # ComfyUI reads LoHa in original naming as it is
    run = run_port(capsys, "convert", adapter, "--to", "original", "--out", tmp_path / "orig", "--json")
    assert run.code == 0 and json.loads(run.out)["kinds"] == {"loha": 1}


def test_adapter_for_another_family_is_refused(base, tmp_path, capsys):
    """A FLUX.1 adapter (img_mod only exists there) does not merge into a FLUX.2 base."""
    part = Part("double_blocks.0.img_mod.lin", "lora", {"down": torch.zeros(2, 64), "up": torch.zeros(384, 2)})
    adapter = write_adapter(tmp_path / "flux1.safetensors", BY_NAME["kohya"], [part])
    run = run_port(capsys, "merge", base["file"], adapter, "--out", tmp_path / "merged")
    assert run.code == 1 and "flux1 adapter" in run.msg and leftovers(tmp_path / "merged") == []


def test_strength_suffix():
    assert parse_strength("style.safetensors:0.8") == (Path("style.safetensors"), 0.8)
    assert parse_strength("style.safetensors") == (Path("style.safetensors"), 1.0)
    assert parse_strength("C:/loras/a.safetensors") == (Path("C:/loras/a.safetensors"), 1.0)
    assert parse_strength("a.safetensors:-1") == (Path("a.safetensors"), -1.0)


def test_converted_adapter_keeps_the_adapter_dtype(base, tmp_path, capsys):
    """A bf16 kohya file (its alphas are float32 scalars) converts to a bf16 diffusers file without alphas."""
    from safetensors.torch import load_file

    from .lorakit import make_parts, weight_shapes

    parts = make_parts(weight_shapes(base["state"], False), ["img_in", "double_blocks.0.img_attn.qkv"], "lora",
                       alpha=1.5)
    adapter = write_adapter(tmp_path / "bf16.safetensors", BY_NAME["kohya"], parts, dtype=torch.bfloat16)
    assert run_port(capsys, "convert", adapter, "--out", tmp_path / "lora", "--quiet").code == 0
    out = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    assert len(out) == 8 and all(t.dtype == torch.bfloat16 for t in out.values())
    assert not any("alpha" in k for k in out)


def test_dry_runs_write_nothing_and_dtype_is_refused(base, tmp_path, capsys):
    adapter, parts = adapter_for(tmp_path / "k.safetensors", BY_NAME["kohya"], base["state"])
    run = run_port(capsys, "convert", adapter, "--dry-run", "--json")
    # 8 BFL modules; the two fused qkv become three modules each
    assert run.code == 0 and json.loads(run.out)["modules_out"] == len(parts) + 4
    run = run_port(capsys, "merge", base["file"], adapter, "--out", tmp_path / "merged", "--dry-run", "--json")
    assert run.code == 0 and json.loads(run.out)["ok"] and leftovers(tmp_path / "merged") == []
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "lora", "--dtype", "bf16")
    assert run.code == 2 and "--dtype" in run.msg and not (tmp_path / "lora").exists()


def test_an_fp8_lora_is_merged_upcast(base, tmp_path, capsys):
    """F8_E4M3 factors (how some trainers save to halve the file) are floating-point: merged upcast to float32,
    bit for bit the merge of the same values stored as float32; converted for diffusers as bf16, not refused."""
    from safetensors.torch import load_file

    from .lorakit import make_parts, weight_shapes

    parts = make_parts(weight_shapes(base["state"], False), ["img_in", "double_blocks.0.img_attn.qkv"], "lora",
                       alpha=1.5)
    fp8 = write_adapter(tmp_path / "fp8.safetensors", BY_NAME["kohya"], parts, dtype=torch.float8_e4m3fn)
    for p in parts:  # the values fp8 holds, stored exactly in float32
        p.factors = {r: t.to(torch.float8_e4m3fn).to(torch.float32) for r, t in p.factors.items()}
    f32 = write_adapter(tmp_path / "f32.safetensors", BY_NAME["kohya"], parts)
    run = run_port(capsys, "merge", base["file"], fp8, "--out", tmp_path / "m8", "--quiet")
    assert run.code == 0, run.msg
    assert run_port(capsys, "merge", base["file"], f32, "--out", tmp_path / "m32", "--quiet").code == 0
    [a], [b] = (sorted((tmp_path / n).glob("*.safetensors")) for n in ("m8", "m32"))
    got, want = load_file(str(a)), load_file(str(b))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    run = run_port(capsys, "convert", fp8, "--out", tmp_path / "lora", "--quiet")
    assert run.code == 0, run.msg
    out = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    assert len(out) == 8 and all(t.dtype == torch.bfloat16 for t in out.values())  # fp8 values are exact in bf16


@pytest.mark.parametrize("naming", ["lycoris-lokr", "bfl-lokr"])
def test_a_lokr_module_that_cannot_make_its_layer_is_refused_without_a_base(base, tmp_path, capsys, naming):
    """lokr_w1 and lokr_w2 that chain but whose Kronecker product is not the layer's shape: without a base, adapter
    convert checks each module against the shapes the family's architecture gives (the sizes the adapter's other
    modules pin), names the module and shapes, and writes nothing; the intact adapter converts."""
    from safetensors.torch import load_file, save_file

    good, _ = adapter_for(tmp_path / "good.safetensors", BY_NAME[naming], base["state"], seed=2)
    tensors = load_file(str(good))
    key = sorted(k for k in tensors if k.endswith("lokr_w2_a"))[-1]
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]]).contiguous()  # one row more: still chains
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    run = run_port(capsys, "convert", tmp_path / "bad.safetensors", "--out", tmp_path / "lora", "--json")
    assert run.code == 2, run.err
    error = json.loads(run.out)["error"]
    w1 = key.replace("w2_a", "w1")
    assert key in error and w1 in error and list(tensors[key].shape).__str__() in error, error
    assert "architecture" in error and "Nothing was written" in error, error
    assert leftovers(tmp_path / "lora") == []
    for to in ("diffusers", "original"):
        ok = run_port(capsys, "convert", good, "--to", to, "--out", tmp_path / f"ok-{to}", "--quiet", "--materialise")
        assert ok.code == 0, ok.msg
    # with a base config, against its real shapes: the same refusal, naming the base's shape
    config = json.loads(run_port(capsys, "inspect", base["file"], "--json").out)["config"]
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({"_class_name": "Flux2Transformer2DModel", **config}))
    run = run_port(capsys, "convert", tmp_path / "bad.safetensors", "--config", tmp_path / "base", "--out",
                   tmp_path / "lora-c", "--json", "--materialise")
    assert run.code == 2, run.err
    error = json.loads(run.out)["error"]
    assert key in error and "in the base (--config)" in error and leftovers(tmp_path / "lora-c") == []
    ok = run_port(capsys, "convert", good, "--config", tmp_path / "base", "--out", tmp_path / "ok-c", "--quiet",
                  "--materialise")
    assert ok.code == 0, ok.msg
