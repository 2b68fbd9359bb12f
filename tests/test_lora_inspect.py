"""`port inspect ADAPTER`: naming, ranks, alphas, targets, and which released base it fits, from headers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from .helpers import TINY2, reference_model, run_port, save_state
from .lorakit import NAMINGS, adapter_for

FORMATS = {"kohya": "kohya / musubi-tuner", "bfl-lora_A": "BFL / ai-toolkit (lora_A/lora_B)",
           "bfl-down-up": "BFL with lora_down/lora_up", "peft-transformer": "diffusers / peft",
           "peft-base_model": "diffusers / peft", "lycoris-lokr": "LyCORIS lokr", "bfl-lokr": "LyCORIS lokr",
           "kohya-loha": "LyCORIS loha", "comfy-diff": "ComfyUI full difference (.diff)"}


@pytest.fixture(scope="module")
def state():
    return reference_model(TINY2, seed=7).state_dict()


@pytest.mark.parametrize("naming", NAMINGS, ids=[n.name for n in NAMINGS])
def test_inspect_names_the_format(state, tmp_path, capsys, naming):
    adapter, parts = adapter_for(tmp_path / "a.safetensors", naming, state)
    run = run_port(capsys, "inspect", adapter, "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["kind"] == "adapter" and doc["family"] == "flux2"
    assert doc["format"] == FORMATS[naming.name]
    assert doc["naming"] == ("diffusers" if naming.diffusers_modules else "original")
    assert doc["modules"] == len(parts) and doc["kinds"] == {naming.kind: len(parts)}
    assert doc["unreadable"] == []
    if naming.kind == "lora":
        assert doc["ranks"] == {"3": len(parts)}
        assert doc["alphas"] == {("none" if naming.alpha is None else f"{naming.alpha:g}"): len(parts)}
    assert doc["fits"] == []  # tiny shapes fit no released model


def test_inspect_tells_which_released_base_fits(tmp_path, capsys):
    """A kohya LoRA with klein-9B shapes (block 7, single block 23) fits klein-9B only."""
    r = 4
    tensors = {
        "lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight": torch.zeros(r, 4096, dtype=torch.bfloat16),
        "lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight": torch.zeros(12288, r, dtype=torch.bfloat16),
        "lora_unet_double_blocks_7_img_attn_qkv.alpha": torch.tensor(2.0),
        "lora_unet_single_blocks_23_linear1.lora_down.weight": torch.zeros(r, 4096, dtype=torch.bfloat16),
        "lora_unet_single_blocks_23_linear1.lora_up.weight": torch.zeros(36864, r, dtype=torch.bfloat16),
        "lora_unet_single_blocks_23_linear1.alpha": torch.tensor(2.0),
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(r, 8),
    }
    save_file(tensors, str(tmp_path / "klein9b.safetensors"))
    run = run_port(capsys, "inspect", tmp_path / "klein9b.safetensors", "--json")
    doc = json.loads(run.out)
    assert run.code == 0 and doc["fits"] == ["klein-9b"]
    assert set(doc["does_not_fit"]) == {"klein-4b", "flux2-dev"}
    assert doc["scales"] == {"0.5": 2} and doc["ranks"] == {"4": 2}
    assert doc["targets"] == {"double_blocks.N.img_attn.qkv": 1, "single_blocks.N.linear1": 1}
    te = "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"
    assert [row["key"] for row in doc["unreadable"]] == [te]
    human = run_port(capsys, "inspect", tmp_path / "klein9b.safetensors")
    assert "klein-9b" in human.out and "kohya" in human.out and "lora_te1_text_model" in human.msg


def test_inspect_of_weights_is_unchanged(tmp_path, capsys):
    weights = save_state(tmp_path / "w.safetensors", reference_model(TINY2).state_dict())
    doc = json.loads(run_port(capsys, "inspect", weights, "--json").out)
    assert doc["family"] == "flux2" and "kind" not in doc and doc["naming"] == "original"
