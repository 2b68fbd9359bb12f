"""Adapters judged by the independent BFL reference forward (tests/reference/flux2_bfl.py), per naming.

For each naming an adapter touches a fused qkv, `linear1`, a shared modulation, `img_in` and the final adaLN (plus
an MLP and `linear2`). The test adds the delta by its own arithmetic (tests/lorakit.py) to the reference weights;
both diffusers models must then compute the same output (fp32, rel L2 < 1e-5):
  (a) `port merge BASE ADAPTER:0.7 --to diffusers`, loaded strictly;
  (b) the base converted by `port convert`, with the adapter converted by `port convert` loaded by diffusers' own
      `load_lora_adapter(FILE, prefix="transformer")`, every module of the file wrapped by peft.
A negative control (the final-layer swap taken out of the table) must fail the same oracle.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from porting.adapters.convert import convert_adapter
from porting.engine.convert import convert
from porting.families.mapping import load_table_file

from .helpers import TINY2, reference_model, run_port, save_state
from .lorakit import BY_NAME, NAMINGS, adapter_for, bfl_deltas
from .reference.flux2_bfl import Flux2Reference
from .test_equivalence import MAPPINGS, flux2_inputs, load_strict

TOL = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The reference model, its BFL file (fp32), the same converted to diffusers, and fixed inputs."""
    root = tmp_path_factory.mktemp("lora")
    reference = reference_model(TINY2, seed=5)
    state = reference.state_dict()
    base = save_state(root / "base.safetensors", state)
    convert(base, root / "base-diffusers", strict=True)
    return {"root": root, "state": state, "base": base, "diffusers": root / "base-diffusers",
            "inputs": flux2_inputs(TINY2)}


def reference_output(world, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
    model = Flux2Reference(TINY2)
    state = {k: v + deltas[k] if k in deltas else v for k, v in world["state"].items()}
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.eval()(**world["inputs"])


def diffusers_output(model, inp) -> torch.Tensor:
    with torch.no_grad():
        return model(hidden_states=inp["x"], encoder_hidden_states=inp["ctx"], timestep=inp["timesteps"],
                     img_ids=inp["x_ids"][0], txt_ids=inp["ctx_ids"][0]).sample


def rel_l2(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((ref - out).norm() / ref.norm()).item()


def assert_oracle(world, deltas, model, tol=TOL) -> None:
    ref = reference_output(world, deltas)
    plain = reference_output(world, {})
    assert rel_l2(ref, plain) > 1e-2, "the adapter must change the output visibly"
    err = rel_l2(ref, diffusers_output(model, world["inputs"]))
    assert err < tol, f"rel L2 {err:.3g}"


def file_modules(path: Path) -> set[str]:
    keys = load_file(str(path))
    out = set()
    for k in keys:
        stem = k.removeprefix("transformer.")
        for marker in (".lora_A.", ".lora_B.", ".lokr_"):
            if marker in stem:
                out.add(stem.split(marker)[0])
    return out


def wrapped_modules(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


@pytest.mark.parametrize("naming", NAMINGS, ids=[n.name for n in NAMINGS])
def test_merged_then_converted_matches_reference(world, tmp_path, capsys, naming):
    adapter, parts = adapter_for(tmp_path / f"{naming.name}.safetensors", naming, world["state"], seed=11)
    run = run_port(capsys, "merge", world["base"], f"{adapter}:0.7", "--out", tmp_path / "merged", "--to",
                   "diffusers", "--quiet")
    assert run.code == 0, run.err
    model = load_strict(Flux2Transformer2DModel, tmp_path / "merged")
    assert_oracle(world, bfl_deltas(parts, world["state"], naming.diffusers_modules, 0.7), model)


@pytest.mark.parametrize("naming", NAMINGS, ids=[n.name for n in NAMINGS])
def test_converted_adapter_loaded_by_diffusers_matches_reference(world, tmp_path, capsys, naming):
    adapter, parts = adapter_for(tmp_path / f"{naming.name}.safetensors", naming, world["state"], seed=12)
    # diffusers loads LoRA and LoKr only: LoHa and full differences need their exact delta written out
    extra = ["--materialise"] if naming.kind in ("loha", "diff") else []
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "lora", "--quiet", *extra)
    assert run.code == 0, run.err
    file = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    model = load_strict(Flux2Transformer2DModel, world["diffusers"])
    model.load_lora_adapter(str(file), prefix="transformer")
    modules = file_modules(file)
    assert modules and wrapped_modules(model) == modules, "every module of the file is loaded, no other"
    assert_oracle(world, bfl_deltas(parts, world["state"], naming.diffusers_modules), model)


def test_pipeline_load_lora_weights_from_the_folder(world, tmp_path, capsys):
    """`pipe.load_lora_weights(DIR)` finds the converted file by its default name and loads every module."""
    from diffusers import Flux2KleinPipeline

    from porting.demo.tinypipe import tiny_components

    adapter, parts = adapter_for(tmp_path / "kohya.safetensors", BY_NAME["kohya"], world["state"], seed=13)
    assert run_port(capsys, "convert", adapter, "--out", tmp_path / "lora", "--quiet").code == 0
    comps = tiny_components(seed=0)
    comps["transformer"] = load_strict(Flux2Transformer2DModel, world["diffusers"])
    pipe = Flux2KleinPipeline(**comps, is_distilled=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    assert wrapped_modules(pipe.transformer) == file_modules(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    assert_oracle(world, bfl_deltas(parts, world["state"], False), pipe.transformer)


def test_merge_to_original_then_port_convert(world, tmp_path, capsys):
    adapter, parts = adapter_for(tmp_path / "bfl.safetensors", BY_NAME["bfl-down-up"], world["state"], seed=14)
    assert run_port(capsys, "merge", world["base"], adapter, "--out", tmp_path / "merged", "--quiet").code == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert run_port(capsys, "convert", tmp_path / "merged", "--out", tmp_path / "tr", "--quiet").code == 0
    model = load_strict(Flux2Transformer2DModel, tmp_path / "tr")
    assert_oracle(world, bfl_deltas(parts, world["state"], False), model)


def test_merge_keeps_a_diffusers_bf16_base_and_sums_adapters(world, tmp_path, capsys):
    """Two adapters in two namings into a bf16 diffusers folder: each weight is W + 0.7 d1 + 0.3 d2 in float32,
    rounded to bf16 once; untouched tensors are byte-identical."""
    base = tmp_path / "bf16"
    convert(world["base"], base, dtype="bf16", strict=True)
    one, parts1 = adapter_for(tmp_path / "kohya.safetensors", BY_NAME["kohya"], world["state"], seed=15)
    two, parts2 = adapter_for(tmp_path / "peft.safetensors", BY_NAME["peft-transformer"], world["state"], seed=16)
    run = run_port(capsys, "merge", base, f"{one}:0.7", f"{two}:0.3", "--out", tmp_path / "merged", "--quiet")
    assert run.code == 0, run.err
    got = load_file(str(tmp_path / "merged" / "diffusion_pytorch_model.safetensors"))
    before = load_file(str(base / "diffusion_pytorch_model.safetensors"))
    assert set(got) == set(before) and all(t.dtype == torch.bfloat16 for t in got.values())
    # expected, by hand, for the fused-qkv part: to_k is rows D..2D of BFL double_blocks.0.img_attn.qkv
    d1 = bfl_deltas(parts1, world["state"], False, 0.7)["double_blocks.0.img_attn.qkv.weight"]
    d2 = bfl_deltas(parts2, world["state"], True, 0.3)["double_blocks.0.img_attn.qkv.weight"]
    rows = slice(TINY2.hidden, 2 * TINY2.hidden)
    want = (before["transformer_blocks.0.attn.to_k.weight"].float() + d1[rows] + d2[rows]).bfloat16()
    merged = got["transformer_blocks.0.attn.to_k.weight"]
    # one rounding of the float32 sum: equal to it but where float32 summation order flips a bf16 rounding
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
    assert ((merged.float() - want.float()).abs() <= ulp).all()
    assert (merged == want).float().mean() > 0.99
    assert torch.equal(got["time_guidance_embed.timestep_embedder.linear_1.weight"],
                       before["time_guidance_embed.timestep_embedder.linear_1.weight"])
    assert not torch.equal(got["norm_out.linear.weight"], before["norm_out.linear.weight"])


def test_negative_control_without_the_final_adaln_b_swap_fails(world, tmp_path):
    """The adapter converted through a table without the final-layer swap loads fine and computes wrong outputs."""
    text = (MAPPINGS / "flux2.toml").read_text()
    swap = 'op = { name = "swap_halves", dim = 0 }\n'
    assert text.count(swap) == 1
    (tmp_path / "noswap.toml").write_text(text.replace(swap, ""))
    broken = load_table_file(tmp_path / "noswap.toml")
    adapter, parts = adapter_for(tmp_path / "kohya.safetensors", BY_NAME["kohya"], world["state"], seed=17,
                                 modules=["final_layer.adaLN_modulation.1", "img_in"])
    convert_adapter(adapter, tmp_path / "good")
    convert_adapter(adapter, tmp_path / "bad", table=broken)
    deltas = bfl_deltas(parts, world["state"], False)
    for name, ok in (("good", True), ("bad", False)):
        model = load_strict(Flux2Transformer2DModel, world["diffusers"])
        model.load_lora_adapter(str(tmp_path / name / "pytorch_lora_weights.safetensors"), prefix="transformer")
        err = rel_l2(reference_output(world, deltas), diffusers_output(model, world["inputs"]))
        assert (err < TOL) == ok, f"{name}: rel L2 {err:.3g}"
        if not ok:
            assert err > 100 * TOL


def test_sparse_rank_3r_kohya_qkv_converts_exactly(world, tmp_path):
    """Three rank-r LoRAs stacked in one kohya qkv (block-diagonal up [3D, 3r]) become three rank-r LoRAs."""
    from .lorakit import Part, write_adapter

    d, r = TINY2.hidden, 2
    gen = torch.Generator().manual_seed(18)
    down = torch.randn(3 * r, d, generator=gen) / d ** 0.5
    up = torch.block_diag(*(torch.randn(d, r, generator=gen) for _ in range(3)))
    part = Part("double_blocks.1.img_attn.qkv", "lora", {"down": down, "up": up}, alpha=3.0)
    adapter = write_adapter(tmp_path / "sparse.safetensors", BY_NAME["kohya"], [part])
    convert_adapter(adapter, tmp_path / "lora")
    file = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    tensors = load_file(str(file))
    for proj in ("to_q", "to_k", "to_v"):
        assert tensors[f"transformer.transformer_blocks.1.attn.{proj}.lora_A.weight"].shape == (r, d)
    model = load_strict(Flux2Transformer2DModel, world["diffusers"])
    model.load_lora_adapter(str(file), prefix="transformer")
    assert_oracle(world, bfl_deltas([part], world["state"], False), model)


def test_lokr_on_fused_qkv_is_refused_unless_materialised(world, tmp_path, capsys):
    """kron(w1, w2) with w1 of 4 rows on a [3D, D] qkv has no exact q/k/v factors: refused with the reason;
    --materialise writes the exact delta instead, which diffusers loads and which matches the reference."""
    from .lorakit import Part, write_adapter

    d = TINY2.hidden
    gen = torch.Generator().manual_seed(19)
    part = Part("double_blocks.0.img_attn.qkv", "lokr",
                {"w1": torch.randn(4, 4, generator=gen), "w2": 0.05 * torch.randn(3 * d // 4, d // 4, generator=gen)})
    adapter = write_adapter(tmp_path / "lokr.safetensors", BY_NAME["bfl-lokr"], [part])
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "refused")
    assert run.code == 2 and not (tmp_path / "refused").exists()
    assert "double_blocks.0.img_attn.qkv" in run.msg and "Kronecker" in run.msg and "--materialise" in run.msg
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "lora", "--materialise", "--json")
    assert run.code == 0, run.err
    file = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    model = load_strict(Flux2Transformer2DModel, world["diffusers"])
    model.load_lora_adapter(str(file), prefix="transformer")
    assert wrapped_modules(model) == {f"transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v")}
    assert_oracle(world, bfl_deltas([part], world["state"], False), model)


@pytest.mark.parametrize("style", ["bfl", "kohya"])
def test_back_to_original_naming_merges_the_same(world, tmp_path, capsys, style):
    """diffusers -> original (kohya or BFL keys): q/k/v LoRAs fuse back onto one qkv; merging it gives the
    reference output."""
    adapter, parts = adapter_for(tmp_path / "peft.safetensors", BY_NAME["peft-transformer"], world["state"], seed=20)
    run = run_port(capsys, "convert", adapter, "--to", "original", "--lora-style", style, "--out", tmp_path / "orig",
                   "--quiet")
    assert run.code == 0, run.err
    back = tmp_path / "orig" / "peft.safetensors"
    keys = load_file(str(back))
    head = {"kohya": "lora_unet_double_blocks_0_img_attn_qkv.", "bfl": "diffusion_model.double_blocks.0.img_attn.qkv."}
    assert any(k.startswith(head[style]) for k in keys)
    run = run_port(capsys, "merge", world["base"], back, "--out", tmp_path / "merged", "--to", "diffusers", "--quiet")
    assert run.code == 0, run.err
    model = load_strict(Flux2Transformer2DModel, tmp_path / "merged")
    assert_oracle(world, bfl_deltas(parts, world["state"], True), model)
