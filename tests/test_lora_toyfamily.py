"""Adapters follow the family registry: a LoRA in a toy family's naming (registered from tests/, no change in
porting/adapters/) converts to the toy's diffusers-style naming and merges into a toy base, checked against the
test's own arithmetic (the toy table's split and half swap written out by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.families import register, unregister

from .helpers import run_port
from .toyfamily.toy import make as make_toy

WIDTH, LAYERS, IN = 4, 2, 3


@pytest.fixture
def toy():
    family = register(make_toy())
    yield family
    unregister(family.name)


def _base(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    state = {"embed.weight": torch.randn(WIDTH, IN, generator=g),
             "head.weight": torch.randn(2 * WIDTH, WIDTH, generator=g)}
    for n in range(LAYERS):
        state[f"blocks.{n}.qkv.weight"] = torch.randn(3 * WIDTH, WIDTH, generator=g)
        state[f"blocks.{n}.out.weight"] = torch.randn(WIDTH, WIDTH, generator=g)
    save_file(state, str(path))
    return state


def _lora(path: Path, rank: int = 2, alpha: float = 1.0) -> dict[str, torch.Tensor]:
    """A kohya-style LoRA on the toy's original modules; returns each module's delta (alpha / rank * B @ A)."""
    g = torch.Generator().manual_seed(4)
    shapes = {"blocks.0.qkv": (3 * WIDTH, WIDTH), "blocks.1.out": (WIDTH, WIDTH), "head": (2 * WIDTH, WIDTH)}
    tensors, deltas = {}, {}
    for module, (rows, cols) in shapes.items():
        up, down = torch.randn(rows, rank, generator=g), torch.randn(rank, cols, generator=g)
        head = "lora_unet_" + module.replace(".", "_")
        tensors.update({f"{head}.lora_up.weight": up, f"{head}.lora_down.weight": down,
                        f"{head}.alpha": torch.tensor(alpha)})
        deltas[module + ".weight"] = alpha / rank * up @ down
    save_file(tensors, str(path))
    return deltas


def _in_diffusers_naming(deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The toy table by hand: qkv splits into to_q / to_k / to_v rows; head -> proj_out with its halves swapped."""
    q, k, v = deltas["blocks.0.qkv.weight"].chunk(3)
    top, bottom = deltas["head.weight"].chunk(2)
    return {"layers.0.to_q.weight": q, "layers.0.to_k.weight": k, "layers.0.to_v.weight": v,
            "layers.1.to_out.weight": deltas["blocks.1.out.weight"], "proj_out.weight": torch.cat([bottom, top])}


def _lora_deltas(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """B @ A of every module of a peft-named file (scale folded in, as port convert writes it)."""
    t = load_file(str(path))
    modules = {k[len(prefix):-len(".lora_A.weight")] for k in t if k.endswith(".lora_A.weight")}
    return {m + ".weight": t[f"{prefix}{m}.lora_B.weight"].float() @ t[f"{prefix}{m}.lora_A.weight"].float()
            for m in modules}


def test_a_toy_family_lora_converts_and_merges_through_the_registry(toy, tmp_path: Path, capsys) -> None:
    base = _base(tmp_path / "toy.safetensors")
    deltas = _lora(tmp_path / "lora.safetensors", alpha=1.0)

    run = run_port(capsys, "inspect", tmp_path / "lora.safetensors", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["family"] == "toy" and doc["modules"] == 3 and doc["unreadable"] == []

    run = run_port(capsys, "convert", tmp_path / "lora.safetensors", "--out", tmp_path / "peft")
    assert run.code == 0, run.err
    converted = _lora_deltas(tmp_path / "peft" / "pytorch_lora_weights.safetensors", "transformer.")
    want = _in_diffusers_naming(deltas)
    assert set(converted) == set(want)
    for key, d in want.items():
        torch.testing.assert_close(converted[key], d, rtol=1e-5, atol=1e-6)

    run = run_port(capsys, "merge", tmp_path / "toy.safetensors", tmp_path / "lora.safetensors:0.5",
                   "--out", tmp_path / "merged")
    assert run.code == 0, run.err
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert set(merged) == set(base)
    for key, w in base.items():
        torch.testing.assert_close(merged[key], w + 0.5 * deltas[key] if key in deltas else w, rtol=1e-5, atol=1e-6)

    # the converted (diffusers-naming) LoRA lands on the same original-naming weights
    run = run_port(capsys, "merge", tmp_path / "toy.safetensors",
                   tmp_path / "peft" / "pytorch_lora_weights.safetensors:0.5", "--out", tmp_path / "merged2")
    assert run.code == 0, run.err
    again = load_file(str(tmp_path / "merged2" / "model.safetensors"))
    for key in base:
        torch.testing.assert_close(again[key], merged[key], rtol=1e-5, atol=1e-6)


def test_a_lora_both_flux_tables_read_goes_to_the_family_declaring_the_higher_priority(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """double_blocks.N.img_attn.qkv is a module of FLUX.1 and of FLUX.2: the families' declarations decide."""
    from porting.families import get_family
    from porting.inputs import open_source
    from porting.inputs.adapter_keys import read_adapter

    path = tmp_path / "shared.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(2, 64),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 2)}, str(path))
    source = open_source(path)
    assert source.kind == "adapter" and source.family == "flux2"
    monkeypatch.setattr(type(get_family("flux1")), "adapter_priority", 5)
    assert read_adapter(source.view).table.name == "flux1"  # the same reading, sorted again


def test_a_lora_on_modules_both_flux_tables_know_merges_into_a_flux1_base(tmp_path: Path, capsys) -> None:
    """With a base, its family reads what several tables know equally: a FLUX.1 LoRA on the fused qkv lands on a
    FLUX.1 base (without the base, the declared priority still says FLUX.2)."""
    import json

    from porting.demo.tiny import write_random_checkpoint
    from porting.families import get_family

    from .helpers import run_port

    flux1 = get_family("flux1")
    base = write_random_checkpoint(tmp_path / "base.safetensors", flux1.tiny_config, table="flux1")
    inner = flux1.tiny_config["num_attention_heads"] * flux1.tiny_config["attention_head_dim"]
    path = tmp_path / "qkv.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.ones(2, inner),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.ones(3 * inner, 2)}, str(path))
    run = run_port(capsys, "inspect", path, "--base", base, "--json")
    assert run.code == 0, run.err
    effect = json.loads(run.out)["effect"]
    assert [r["module"] for r in effect["modules"]] == ["double_blocks.0.img_attn.qkv.weight"]
    assert effect["unplaced"] == []
    run = run_port(capsys, "merge", base, path, "--out", tmp_path / "merged", "--json")
    assert run.code == 0, run.err
    assert json.loads(run.out)["adapter_effect"]["counts"]["ok"] == 1
