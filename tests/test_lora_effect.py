"""A LoRA that does nothing is caught: `port inspect ADAPTER --base` and `port merge` measure each module's delta
against the base weight it lands on, flag deltas below bf16's resolution of that weight (and zero ones), and list
keys that land nowhere. Numbers are checked against the test's own torch arithmetic (lorakit's hand placement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.adapters import effect as E

from .helpers import run_port
from .lorakit import BY_NAME, adapter_for, bfl_deltas

MODULE = "double_blocks.0.img_attn.qkv"


@pytest.fixture(scope="module")
def base(tiny2_file: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny2_file))


def _lokr_constant(path: Path, module: str, shape: tuple[int, int], value: float) -> Path:
    """A LoKr whose delta is `value` at every element: kron([[value]], ones) (no alpha: scale 1)."""
    save_file({f"diffusion_model.{module}.lokr_w1": torch.tensor([[value]]),
               f"diffusion_model.{module}.lokr_w2": torch.ones(shape)}, str(path))
    return path


def _inspect(capsys, adapter: Path, base: Path, *extra: str) -> dict:
    run = run_port(capsys, "inspect", adapter, "--base", base, "--json", *extra)
    assert run.code == 0, run.err
    return json.loads(run.out)["effect"]


def test_a_lokr_below_bf16_resolution_on_klein_is_flagged_no_effect_and_a_normal_one_is_not(
        base, tiny2_file, tmp_path, capsys) -> None:
    w = base[MODULE + ".weight"].float()
    assert bool((w != 0).all())  # a zero weight element has no half-ulp margin
    # half a bf16 ulp of x is more than |x| 2^-9 above, and |x| 2^-10 below a power of two: 2^-11 of the smallest
    # element is below it everywhere; 2^-6 of the largest is more than an ulp of every element
    small = _lokr_constant(tmp_path / "small.safetensors", MODULE, tuple(w.shape), float(w.abs().min()) * 2 ** -11)
    large = _lokr_constant(tmp_path / "large.safetensors", MODULE, tuple(w.shape), float(w.abs().max()) * 2 ** -6)
    doc = _inspect(capsys, small, tiny2_file)
    (row,) = doc["modules"]
    assert row["module"] == MODULE + ".weight" and row["status"] == "no effect" and row["changed"] == 0
    assert doc["counts"] == {"modules": 1, "ok": 0, "no effect": 1, "zero": 0, "unplaced": 0}
    run = run_port(capsys, "inspect", small, "--base", tiny2_file)  # the human table says so too
    assert run.code == 0 and "no effect" in run.out and "would not change the bf16 weights" in run.msg
    (row,) = _inspect(capsys, large, tiny2_file)["modules"]
    assert row["status"] == "ok" and row["changed"] == w.numel()
    # the large LoKr at the strength that scales it down to the small one's delta: flagged
    strength = (float(w.abs().min()) * 2 ** -11) / (float(w.abs().max()) * 2 ** -6)
    (row,) = _inspect(capsys, large, tiny2_file, "--strength", repr(strength))["modules"]
    assert row["status"] == "no effect"


@pytest.mark.parametrize("value, status", [
    (2 ** -8, "no effect"),  # 1 + half an ulp: a tie, rounds to even (1.0)
    (2 ** -8 * (1 + 2 ** -14), "ok"),  # just above half an ulp (1 + d exact in float32): 1 + 2^-7
    (-(2 ** -9), "no effect"),  # below 1.0 the spacing is 2^-8: half of it is a tie again
    (-(2 ** -9) * (1 + 2 ** -14), "ok"),  # just past it: 1 - 2^-8
    (0.0, "zero"),
])
def test_both_sides_of_the_bf16_threshold(base, tmp_path, capsys, value, status) -> None:
    """A base weight of ones: the threshold is half a bf16 ulp of 1.0, 2^-8 above and 2^-9 below."""
    state = dict(base)
    ones = torch.ones_like(state[MODULE + ".weight"])
    state[MODULE + ".weight"] = ones
    save_file(state, str(tmp_path / "ones.safetensors"))
    lokr = _lokr_constant(tmp_path / "c.safetensors", MODULE, tuple(ones.shape), value)
    (row,) = _inspect(capsys, lokr, tmp_path / "ones.safetensors")["modules"]
    assert row["status"] == status
    assert row["changed"] == (ones.numel() if status == "ok" else 0)
    assert row["max_abs"] == pytest.approx(abs(value), rel=1e-6)
    assert row["rel_norm"] == pytest.approx(abs(value), rel=1e-6)  # ||c * 1|| / ||1||


@pytest.mark.parametrize("naming", ["kohya", "peft-transformer"])
def test_rows_equal_an_independent_torch_computation(base, tiny2_file, tmp_path, capsys, naming) -> None:
    """Per base tensor: ||d|| / ||W||, max |d| and the bf16 elements changed, with d placed by hand (a diffusers
    LoRA's q / k / v rows into the fused qkv)."""
    adapter, parts = adapter_for(tmp_path / "a.safetensors", BY_NAME[naming], base, seed=5)
    deltas = bfl_deltas(parts, {k: v.float() for k, v in base.items()}, BY_NAME[naming].diffusers_modules,
                        strength=0.7)
    doc = _inspect(capsys, adapter, tiny2_file, "--strength", "0.7")
    rows = {r["module"]: r for r in doc["modules"]}
    assert set(rows) == set(deltas) and doc["unplaced"] == [] and doc["strength"] == 0.7
    for key, d in deltas.items():
        w = base[key]
        r = rows[key]
        assert r["rel_norm"] == pytest.approx(float(d.norm() / w.float().norm()), rel=1e-4)
        assert r["max_abs"] == pytest.approx(float(d.abs().max()), rel=1e-4)
        assert r["changed"] == int(((w.float() + d).bfloat16() != w).sum())
        assert r["status"] == "ok"


def test_keys_that_land_nowhere_are_flagged(base, tiny2_file, tmp_path, capsys) -> None:
    adapter, parts = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1,
                                 modules=["double_blocks.1.img_mlp.0"])
    tensors = load_file(str(adapter))
    tensors["lora_unet_double_blocks_9_img_attn_qkv.lora_down.weight"] = torch.zeros(3, 64)  # block 9 of 2
    tensors["lora_unet_double_blocks_9_img_attn_qkv.lora_up.weight"] = torch.zeros(192, 3)
    tensors["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(3, 8)
    save_file(tensors, str(adapter))
    doc = _inspect(capsys, adapter, tiny2_file)
    assert doc["counts"]["unplaced"] == 2 and doc["counts"]["modules"] == 1
    why = " | ".join(f"{u['keys']}: {u['why']}" for u in doc["unplaced"])
    assert "double_blocks_9_img_attn_qkv" in why and "lora_te1_text_model" in why


def test_an_untrained_lora_is_zero_and_merge_json_and_manifest_carry_the_summary(base, tiny2_file, tmp_path,
                                                                                 capsys) -> None:
    adapter, parts = adapter_for(tmp_path / "a.safetensors", BY_NAME["bfl-lora_A"], base, seed=2,
                                 modules=["double_blocks.1.img_mlp.0", "single_blocks.0.linear1"])
    tensors = load_file(str(adapter))
    tensors["diffusion_model.single_blocks.0.linear1.lora_B.weight"].zero_()  # as peft initialises it
    save_file(tensors, str(adapter))
    inspected = _inspect(capsys, adapter, tiny2_file)
    run = run_port(capsys, "merge", tiny2_file, adapter, "--out", tmp_path / "merged", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)["adapter_effect"]
    rows = {r["module"]: r for r in doc["modules"]}
    assert rows["single_blocks.0.linear1.weight"]["status"] == "zero"
    assert rows["double_blocks.1.img_mlp.0.weight"]["status"] == "ok"
    assert doc["counts"] == {"modules": 2, "ok": 1, "no effect": 0, "zero": 1, "unplaced": 0}
    for r in inspected["modules"]:  # merge measures what inspect measures
        got = rows[r["module"]]
        assert (got["status"], got["changed"]) == (r["status"], r["changed"])
        assert got["rel_norm"] == pytest.approx(r["rel_norm"], rel=1e-5)
    manifest = json.loads((tmp_path / "merged" / "flux-port.json").read_text())
    assert manifest["adapter_effect"]["counts"] == doc["counts"]
    # the human run prints the counts and the flagged module on stderr
    run = run_port(capsys, "merge", tiny2_file, adapter, "--out", tmp_path / "merged2")
    assert run.code == 0 and "1 no effect" not in run.msg and "0 no effect, 1 zero" in run.msg
    assert "zero: single_blocks.0.linear1.weight" in run.msg


def test_measure_reads_blocks_of_rows_with_the_same_numbers(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 11, generator=g).bfloat16()
    d = torch.randn(37, 11, generator=g) * 2e-3
    whole = E.measure(w, delta=d)
    monkeypatch.setattr(E, "BLOCK", 20)  # one row and a bit per block
    blocks = E.measure(w, delta=d)
    merged = E.measure(w, merged=w.float() + d)
    as_fp32 = E.measure(w.float(), delta=d)  # an fp32 base is judged at bf16 all the same
    assert as_fp32["changed"] == whole["changed"] and as_fp32["rel_norm"] == pytest.approx(whole["rel_norm"])
    assert blocks["changed"] == whole["changed"] == int(((w.float() + d).bfloat16() != w).sum()) == merged["changed"]
    for k in ("rel_norm", "max_abs"):
        assert blocks[k] == pytest.approx(whole[k], rel=1e-6) and merged[k] == pytest.approx(whole[k], rel=1e-5)


def test_strength_is_checked_and_needs_a_base(base, tiny2_file, tmp_path, capsys) -> None:
    adapter, _ = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1)
    run = run_port(capsys, "inspect", adapter, "--strength", "0.5")
    assert run.code == 2 and "--strength needs --base" in run.msg
    run = run_port(capsys, "inspect", adapter, "--base", tiny2_file, "--strength", "nan")
    assert run.code == 2 and "--strength" in run.msg and "Traceback" not in run.err
    run = run_port(capsys, "inspect", tiny2_file, "--strength", "0.5")
    assert run.code == 2 and "--strength is for an adapter" in run.msg


def test_merge_measures_two_adapters_summed_as_merge_adds_them(base, tiny2_file, tmp_path, capsys) -> None:
    """Merge's block path (the measure fed per block on the merge threads): with two adapters on one module the
    row is the summed delta's, equal to the test's own torch arithmetic."""
    one, parts1 = adapter_for(tmp_path / "one.safetensors", BY_NAME["kohya"], base, seed=3)
    two, parts2 = adapter_for(tmp_path / "two.safetensors", BY_NAME["kohya"], base, seed=4,
                              modules=["double_blocks.0.img_attn.qkv", "single_blocks.1.linear1"])
    state = {k: v.float() for k, v in base.items()}
    d1 = bfl_deltas(parts1, state, False, strength=0.7)
    d2 = bfl_deltas(parts2, state, False, strength=-1.3)
    run = run_port(capsys, "merge", tiny2_file, f"{one}:0.7", f"{two}:-1.3", "--out", tmp_path / "m", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)["adapter_effect"]
    rows = {r["module"]: r for r in doc["modules"]}
    assert set(rows) == set(d1) | set(d2) and set(d1) & set(d2)
    assert doc["counts"]["ok"] == len(rows)  # the counts follow the rows measured block by block
    for key in rows:
        w = base[key]
        merged = w.float()
        for d in (d1, d2):  # in merge's order: W + d1, then + d2
            merged = merged + d[key] if key in d else merged
        total = merged - w.float()
        r = rows[key]
        assert r["rel_norm"] == pytest.approx(float(total.norm() / w.float().norm()), rel=1e-4), key
        assert r["max_abs"] == pytest.approx(float(total.abs().max()), rel=1e-4), key
        assert r["changed"] == int((merged.bfloat16() != w).sum()), key


def test_a_huge_finite_delta_gets_its_true_norm_not_an_infinity() -> None:
    """Squares of 2e30 overflow float32; the norm is the delta's own, so rel_norm is a number (not null)."""
    weight = torch.ones(4, 8, dtype=torch.bfloat16)
    row = E.measure(weight, delta=torch.full((4, 8), 2e30))
    assert row["rel_norm"] == pytest.approx(2e30, rel=1e-6) and row["status"] == "ok"
    block = E.Effect().blockwise("m", 32)
    d_sq, lo, hi = E.effect_of(torch.full((4, 8), 2e30))
    block.block(d_sq, E.squares(weight.float()), max(-lo, hi), 32)
    assert block.row["rel_norm"] == pytest.approx(2e30, rel=1e-6)
