"""`port merge`'s numbers against an independent computation, and the writer's two ways of copying.

Every merged weight must be, bit for bit, bf16(W + s1 * (B1 @ A1) + s2 * (B2 @ A2)) computed here in float32 with
plain torch (s = strength * alpha / rank, each product rounded to float32, then scaled, then added in order);
untouched tensors byte-identical. Blocks and writer buffers are made tiny so one weight spans many blocks and
buffers (the row-block arithmetic must not show). Merging straight into diffusers naming (row splits, the
final-layer swap) must give the tensors of merging and then converting.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.adapters import merge as merge_module
from porting.adapters.merge import merge
from porting.engine.convert import convert
from porting.tensors import writer

from .helpers import TINY2, assert_same_tensors, load_folder, reference_model, save_state


def kohya(path, state, modules, rank, seed, alpha):
    """A kohya LoRA on `modules` (BFL names); returns {module: (up, down)} as float32."""
    gen = torch.Generator().manual_seed(seed)
    tensors, factors = {}, {}
    for module in modules:
        out, inp = state[module + ".weight"].shape
        down = (torch.randn(rank, inp, generator=gen) / inp ** 0.5).bfloat16()
        up = (0.3 * torch.randn(out, rank, generator=gen)).bfloat16()
        stem = "lora_unet_" + module.replace(".", "_")
        tensors |= {stem + ".lora_down.weight": down, stem + ".lora_up.weight": up,
                    stem + ".alpha": torch.tensor(alpha)}
        factors[module] = (up.float(), down.float())
    save_file(tensors, str(path))
    return factors


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge-numbers")
    state = {k: v.bfloat16() for k, v in reference_model(TINY2, seed=3).state_dict().items()}
    base = save_state(root / "base.safetensors", state)
    linears = sorted(k[: -len(".weight")] for k, v in state.items() if v.ndim == 2)
    one = kohya(root / "one.safetensors", state, linears, rank=4, seed=1, alpha=3.0)
    two = kohya(root / "two.safetensors", state, linears[::3], rank=2, seed=2, alpha=2.0)
    return {"root": root, "state": state, "base": base, "one": one, "two": two}


@pytest.fixture
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(merge_module, "BLOCK_ELEMENTS", 1000)  # a 64-wide weight: 15 rows a block
    monkeypatch.setattr(writer, "READ_PIECE", 4096)  # 32 rows a writer buffer


def independent(world, strengths):
    want = {}
    for key, w in world["state"].items():
        total = w.float()
        touched = False
        for (name, rank, alpha), strength in zip((("one", 4, 3.0), ("two", 2, 2.0)), strengths):
            module = key[: -len(".weight")]
            if key.endswith(".weight") and module in world[name]:
                up, down = world[name][module]
                total = total + (strength * (alpha / rank)) * (up @ down)
                touched = True
        want[key] = total.bfloat16() if touched else w
    return want


def test_merged_weights_equal_an_independent_float32_computation_bit_for_bit(world, tmp_path, tiny_blocks):
    root = world["root"]
    merge(world["base"], [(root / "one.safetensors", 0.7), (root / "two.safetensors", -1.3)], tmp_path / "m")
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    want = independent(world, (0.7, -1.3))
    assert_same_tensors(got, want)
    touched = [k for k in want if not torch.equal(want[k], world["state"][k])]
    assert len(touched) == len(world["one"])  # every linear changed; biases and norms byte-identical


def test_merging_into_diffusers_naming_equals_merging_then_converting(world, tmp_path, tiny_blocks):
    root = world["root"]
    adapters = [(root / "one.safetensors", 0.7)]
    direct = merge(world["base"], adapters, tmp_path / "direct", to="diffusers")
    merge(world["base"], adapters, tmp_path / "kept")
    after = convert(tmp_path / "kept" / "model.safetensors", tmp_path / "after", strict=True)
    assert_same_tensors(load_folder(tmp_path / "direct"), load_folder(tmp_path / "after"))
    assert direct.weights_sha256 == after.weights_sha256


def test_the_copy_falls_back_to_read_and_write_where_the_kernel_cannot_copy(world, tmp_path, monkeypatch):
    """copy_file_range refused (EXDEV: another file system on older kernels): the same bytes and weights identity,
    read and written by the process instead."""
    kernel = convert(world["base"], tmp_path / "kernel", strict=True)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    fallback = convert(world["base"], tmp_path / "fallback", strict=True)
    assert calls, "the kernel copy was not tried"
    assert fallback.weights_sha256 == kernel.weights_sha256
    assert_same_tensors(load_folder(tmp_path / "fallback"), load_folder(tmp_path / "kernel"))
    manifest = json.loads((tmp_path / "fallback" / "flux-port.json").read_text())
    assert manifest["weights_sha256"] == kernel.weights_sha256


def test_a_copy_error_other_than_unsupported_is_raised_and_nothing_is_written(world, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "copy_file_range", broken)
    with pytest.raises(Exception, match="Input/output error|I/O"):
        convert(world["base"], tmp_path / "out", strict=True)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == []


def test_a_quantized_base_is_merged_whole_with_the_same_arithmetic(world, tmp_path, tiny_blocks):
    """Into a ComfyUI scaled-fp8 base (its block linears are computed, so they take the whole-tensor path): each
    merged weight is bf16(dequantized W + s * (B @ A)), W dequantized by comfy-kitchen's own code."""
    from .quantfiles import comfy_scaled_fp8

    stored, oracle = comfy_scaled_fp8(world["state"])
    base = tmp_path / "fp8.safetensors"
    save_file(stored, str(base))
    merge(base, [(world["root"] / "one.safetensors", 0.7)], tmp_path / "m")
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    scale = 0.7 * 3.0 / 4
    for key, w in oracle.items():
        module = key[: -len(".weight")]
        if key.endswith(".weight") and module in world["one"]:
            up, down = world["one"][module]
            w = w + scale * (up @ down)
        assert torch.equal(got[key], w.bfloat16()), key  # written without the ComfyUI prefix


@pytest.mark.parametrize("s", [0.5, 0.25, -2.0, 4.0])
def test_a_power_of_two_multiplier_folded_into_the_down_factor_gives_the_same_bits(s: float) -> None:
    """merge scales a LoRA's down factor once by a power-of-two multiplier (alpha = rank / 2) instead of every
    block of rows: the same float32 values, bit for bit, as the product scaled afterwards."""
    gen = torch.Generator().manual_seed(0)
    up, down = torch.randn(300, 64, generator=gen) * 0.01, torch.randn(64, 1000, generator=gen)
    assert torch.equal(up @ (down * s), (up @ down) * s)
    assert not torch.equal(up @ (down * 0.3), (up @ down) * 0.3)  # what is not a power of two is not folded


@pytest.mark.parametrize("strength", [0.7, 2 / 3])  # s = 0.525 scales each block; s = 0.5 is folded into A
def test_the_effect_merge_reports_is_the_whole_tensor_measure(world, tmp_path, tiny_blocks, strength):
    """Merge measures each module block by block, the delta's norm from the LoRA's factors (no pass over the
    block): the same numbers as `measure` on the whole weight and the test's own delta s * (B @ A)."""
    from porting.adapters.effect import measure

    result = merge(world["base"], [(world["root"] / "one.safetensors", strength)], tmp_path / "m")
    rows = {r["module"]: r for r in result.extra["adapter_effect"]["modules"]}
    assert set(rows) == {m + ".weight" for m in world["one"]}
    for module, (up, down) in world["one"].items():
        w = world["state"][module + ".weight"]
        want = measure(w, delta=(up @ down) * (strength * 3.0 / 4))
        got = rows[module + ".weight"]
        assert (got["status"], got["changed"], got["elements"]) == (want["status"], want["changed"],
                                                                     want["elements"]), module
        for k in ("rel_norm", "max_abs", "weight_norm"):
            assert got[k] == pytest.approx(want[k], rel=1e-5), (module, k)


@pytest.mark.parametrize("what, strength", [("an fp16 base", 1e6), ("a bf16 base", 1e30), ("a NaN", 1.0)])
def test_a_sum_that_does_not_fit_the_base_dtype_is_refused_and_nothing_is_written(world, tmp_path, tiny_blocks,
                                                                                  what, strength):
    """The block path looks at the rounded block only when the measure's bound (||W|| + max |d|) cannot rule out
    an overflow: a sum past the base dtype's largest (fp16's 65504; bf16's, where float32 overflows too) or a NaN
    in the base is still caught, naming the tensor."""
    module = "double_blocks.0.img_attn.qkv"
    state = {k: v.half() for k, v in world["state"].items()} if what == "an fp16 base" else dict(world["state"])
    if what == "a NaN":
        state[module + ".weight"] = state[module + ".weight"].clone()
        state[module + ".weight"][5, 3] = float("nan")
    base = save_state(tmp_path / "base.safetensors", state)
    lora = tmp_path / "lora.safetensors"
    kohya(lora, state, [module], rank=4, seed=1, alpha=4.0)
    if what == "a bf16 base":  # factors of 1e30 x 1e10: the product overflows float32 (a strength is checked)
        tensors = load_file(str(lora))
        stem = "lora_unet_" + module.replace(".", "_")
        tensors[stem + ".lora_down.weight"] *= 1e10
        save_file(tensors, str(lora))
    with pytest.raises(Exception, match=r"double_blocks\.0\.img_attn\.qkv\.weight plus the delta") as err:
        merge(base, [(lora, strength)], tmp_path / "m")
    assert getattr(err.value, "hint", None) == merge_module.SUM_HINT, err.value
    assert not (tmp_path / "m").exists()
