"""No NaN, Inf or overflow written, ever (issue 17, item 6).

Each refusal runs the real CLI on real small files (adapters from lorakit, quantized files from their producers
in quantfiles, then damaged where the case says), and asserts exit 1, the tensor or value named, no traceback,
nothing written: every file under the test's folder (inputs, a neighbour's notes, the output's parent) hashes the
same before and after, and no output, staging or backup folder is left.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from . import quantfiles as qf
from .helpers import TINY2, leftovers, reference_model, run_port, save_state
from .lorakit import BFL_MODULES, BY_NAME, DIFFUSERS_MODULES, make_parts, weight_shapes, write_adapter
from .test_safety import assert_clean_refusal, snapshot

NAN, INF = float("nan"), float("inf")
QKV = "double_blocks.0.img_attn.qkv"


@pytest.fixture(scope="module")
def state():
    return reference_model(TINY2, seed=7).state_dict()


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """The user's folder: the inputs go here, next to notes of theirs that must stay as they are."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "notes.txt").write_text("my settings\n")
    return folder


def refused(capsys, tmp_path: Path, *argv, phrases: tuple[str, ...], code: int = 1):
    """Run `port ARGV`; it must refuse cleanly and leave every file under tmp_path as it was."""
    before = snapshot(tmp_path)
    run = run_port(capsys, *argv)
    assert_clean_refusal(run, code, *phrases)
    assert snapshot(tmp_path) == before, "an input or a neighbour changed, or something was written"
    assert leftovers(tmp_path / "out") == []
    return run


def _adapter(folder: Path, state, naming: str = "kohya", change=None, dtype: torch.dtype = torch.float32,
             name: str = "adapter.safetensors", extra: dict | None = None) -> Path:
    n = BY_NAME[naming]
    modules = DIFFUSERS_MODULES[:2] if n.diffusers_modules else [QKV, BFL_MODULES[2]]
    parts = make_parts(weight_shapes(state, n.diffusers_modules), modules, n.kind, seed=3, alpha=n.alpha)
    if change:
        change(parts[0])
    return write_adapter(folder / name, n, parts, extra=extra, dtype=dtype)


def _set(role: str, value: float):
    def change(part):
        part.factors[role] = part.factors[role].clone()
        part.factors[role].view(-1)[1] = value
    return change


# --- adapters: factors, alphas, ranks, strengths -------------------------------------------------------------------

@pytest.mark.parametrize("naming, role, value, key", [
    ("kohya", "down", NAN, "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"),
    ("kohya", "up", INF, "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"),
    ("bfl-lokr", "w1", NAN, f"diffusion_model.{QKV}.lokr_w1"),
    ("bfl-lokr", "w2_b", -INF, f"diffusion_model.{QKV}.lokr_w2_b"),
    ("kohya-loha", "w2_a", NAN, "lora_unet_double_blocks_0_img_attn_qkv.hada_w2_a"),
    ("comfy-diff", "diff", INF, f"diffusion_model.{QKV}.diff"),
], ids=["lora-down-nan", "lora-up-inf", "lokr-w1-nan", "lokr-w2_b-inf", "loha-nan", "diff-inf"])
def test_a_non_finite_adapter_factor_is_refused_by_merge_and_convert(capsys, tmp_path, inputs, state, naming, role,
                                                                     value, key):
    base = save_state(inputs / "base.safetensors", state)
    adapter = _adapter(inputs, state, naming, _set(role, value))
    out = tmp_path / "out"
    refused(capsys, tmp_path, "merge", base, adapter, "--out", out,
            phrases=(str(adapter), f"adapter factor {key!r}", "NaN or infinite value(s)", "nothing was written"))
    refused(capsys, tmp_path, "convert", adapter, "--to", "original", "--out", out,
            phrases=(f"adapter factor {key!r}", "NaN or infinite value(s)"))


@pytest.mark.parametrize("alpha", [NAN, INF, -INF])
def test_a_non_finite_alpha_is_refused(capsys, tmp_path, inputs, state, alpha):
    def change(part):
        part.alpha = alpha

    base = save_state(inputs / "base.safetensors", state)
    adapter = _adapter(inputs, state, "kohya", change)
    key = "lora_unet_double_blocks_0_img_attn_qkv.alpha"
    for argv in (("merge", base, adapter), ("convert", adapter), ("inspect", adapter)):
        refused(capsys, tmp_path, *argv, *(["--out", tmp_path / "out"] if argv[0] != "inspect" else []),
                phrases=(f"alpha {key!r} is {alpha}, not a finite number",))


def test_an_alpha_that_is_not_a_scalar_is_refused(capsys, tmp_path, inputs, state):
    key = "lora_unet_double_blocks_0_img_attn_qkv.alpha"

    def change(part):
        part.alpha = None  # written below, with two values

    base = save_state(inputs / "base.safetensors", state)
    adapter = _adapter(inputs, state, "kohya", change, extra={key: torch.tensor([3.0, 3.0])})
    refused(capsys, tmp_path, "merge", base, adapter, "--out", tmp_path / "out",
            phrases=(f"alpha {key!r} has shape [2]", "one number"))


def test_a_rank_of_zero_is_refused(capsys, tmp_path, inputs, state):
    def change(part):
        part.factors = {"down": torch.zeros(0, 64), "up": torch.zeros(192, 0)}

    base = save_state(inputs / "base.safetensors", state)
    adapter = _adapter(inputs, state, "kohya", change)
    key = "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
    for argv in (("merge", base, adapter, "--out", tmp_path / "out"), ("convert", adapter, "--out", tmp_path / "out")):
        refused(capsys, tmp_path, *argv, phrases=(f"{key!r} has shape [0, 64]: rank 0", "at least 1"))


@pytest.mark.parametrize("r", [-4, 0, "nan"])
def test_a_negative_or_zero_rank_in_peft_metadata_is_refused(capsys, tmp_path, inputs, state, r):
    base = save_state(inputs / "base.safetensors", state)
    plain = _adapter(inputs, state, "peft-transformer", name="plain.safetensors")
    adapter = inputs / "adapter.safetensors"
    save_file(load_file(str(plain)), str(adapter),
              metadata={"lora_adapter_metadata": json.dumps({"r": r, "lora_alpha": 8})})
    plain.unlink()
    refused(capsys, tmp_path, "merge", base, adapter, "--out", tmp_path / "out",
            phrases=(str(adapter), f"rank r = {r!r}", "positive"))


@pytest.mark.parametrize("strength", ["nan", "inf", "-inf"])
def test_a_non_finite_strength_on_the_command_line_is_refused(capsys, tmp_path, inputs, state, strength):
    base = save_state(inputs / "base.safetensors", state)
    adapter = _adapter(inputs, state)
    refused(capsys, tmp_path, "merge", base, f"{adapter}:{strength}", "--out", tmp_path / "out",
            phrases=(f"{adapter}: strength is {float(strength)}, not a finite number",))


def test_a_strength_whose_delta_overflows_float32_is_refused(capsys, tmp_path, inputs, state):
    """1e39 is a finite Python float; the float32 delta it scales is not. bf16 has float32's range, so this is how
    a bf16 base overflows."""
    base = save_state(inputs / "base.safetensors", state, torch.bfloat16)
    adapter = _adapter(inputs, state)
    refused(capsys, tmp_path, "merge", base, f"{adapter}:1e39", "--out", tmp_path / "out",
            phrases=(str(adapter), "strength 1e+39 x scale 0.5 for double_blocks.0.img_attn.qkv.weight",
                     "beyond float32's range"))
    # a strength that fits float32, on factors whose product with it does not: caught in the sum
    def large(part):
        part.factors["up"] = part.factors["up"] * 1e6

    strong = _adapter(inputs, state, "kohya", large, name="strong.safetensors")
    refused(capsys, tmp_path, "merge", base, f"{strong}:1e36", "--out", tmp_path / "out",
            phrases=(f"{QKV}.weight plus the delta of strong.safetensors x1e+36", "NaN or infinite value(s)"))


def test_a_merge_into_an_fp16_base_whose_result_exceeds_fp16_is_refused(capsys, tmp_path, inputs, state):
    base = save_state(inputs / "base.safetensors", state, torch.float16)
    adapter = _adapter(inputs, state)
    strength = "1e7"
    run = refused(capsys, tmp_path, "merge", base, f"{adapter}:{strength}", "--out", tmp_path / "out",
                  phrases=(str(base), f"{QKV}.weight plus the delta of adapter.safetensors x1e+07",
                           "would overflow fp16", "the largest fp16 is 65504"))
    assert "lower the adapter's strength" in run.msg.lower()
    # the same merge into a float32 copy of the base fits, and is written
    wide = save_state(inputs / "base32.safetensors", state)
    ok = run_port(capsys, "merge", wide, f"{adapter}:{strength}", "--out", tmp_path / "ok", "-q")
    assert ok.code == 0, ok.err
    assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / "ok" / "model.safetensors")).values())


def test_an_adapter_whose_folded_scale_overflows_its_dtype_is_not_converted(capsys, tmp_path, inputs, state):
    """alpha / rank is folded into lora_B when converting; in an fp16 adapter that product must still fit fp16."""
    def change(part):
        part.alpha = 3e6  # x 1e6 on a rank-3 LoRA

    adapter = _adapter(inputs, state, "kohya", change, dtype=torch.float16)
    refused(capsys, tmp_path, "convert", adapter, "--out", tmp_path / "out",
            phrases=("transformer.transformer_blocks.0.attn.to_q.lora_B.weight", "would overflow fp16"))


# --- quantized sources: scales and dequantized blocks --------------------------------------------------------------

def _fp8(value: float, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    return torch.tensor(value).to(dtype)


def _quantized(kind: str, state, folder: Path, key: str, damage) -> Path:
    """A producer-written quantized file with `key` replaced by `damage(key's tensor)`."""
    if kind == "comfy-scaled-fp8":
        tensors, _ = qf.comfy_scaled_fp8(state)
        meta = None
    elif kind.startswith("comfy-"):
        fmt, _, extra = kind[len("comfy-"):].partition("+")
        tensors, _, meta = qf.comfy_mixed(state, fmt, pre_quant_scale=extra == "pqs")
    elif kind == "bfl-fp8":
        (tensors, _), meta = qf.bfl_fp8(state), None
    elif kind == "diffusers-bfl":
        (tensors, _), meta = qf.diffusers_bfl(state), None
    else:
        (tensors, _), meta = qf.modelopt_int8(state), None
    tensors[key] = damage(tensors[key].clone())
    return qf.save(folder / "model.safetensors", tensors, meta or None)


def _at(i: int, value):
    def damage(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[i] = value
        return t
    return damage


def _byte(i: int, code: int):
    def damage(t: torch.Tensor) -> torch.Tensor:
        t.view(torch.uint8).view(-1)[i] = code
        return t
    return damage


SCALES = [
    ("comfy-scaled-fp8", f"model.diffusion_model.{QKV}.scale_weight", _at(0, 0.0), "0.0"),
    ("comfy-scaled-fp8", f"model.diffusion_model.{QKV}.scale_weight", _at(0, -0.25), "-0.25"),
    ("comfy-scaled-fp8", f"model.diffusion_model.{QKV}.scale_weight", _at(0, NAN), "nan"),
    ("comfy-float8_e4m3fn", f"{QKV}.weight_scale", _at(0, INF), "inf"),
    ("comfy-float8_e4m3fn+pqs", f"{QKV}.pre_quant_scale", _at(5, NAN), "index 5: nan"),
    ("comfy-int8_tensorwise", f"{QKV}.weight_scale", _at(0, -1.0), "-1.0"),
    ("bfl-fp8", f"{QKV}.weight_scale", _at(0, 0.0), "0.0"),
    ("diffusers-bfl", f"{QKV}.weight_scale", _at(7, -0.5), "index 7: -0.5"),  # fp8r, one scale per row
    ("diffusers-bfl", "single_blocks.0.linear1.weight_scale_2", _at(0, 0.0), "0.0"),
    ("modelopt-int8", f"{QKV}.weight_scale", _at(3, 0.0), "index 3: 0.0"),  # per channel
    ("comfy-nvfp4", f"{QKV}.weight_scale_2", _at(0, NAN), "nan"),
    ("comfy-nvfp4", f"{QKV}.weight_scale", _at(9, _fp8(-2.0)), "index 9: -2.0"),  # block scale, negative
    ("comfy-nvfp4", f"{QKV}.weight_scale", _byte(9, 0x7F), "index 9: nan"),  # E4M3 NaN code
    ("comfy-mxfp8", f"{QKV}.weight_scale", _byte(2, 0xFF), "index 2: nan"),  # E8M0 NaN
]


@pytest.mark.parametrize("kind, key, damage, value", SCALES,
                         ids=[f"{k}:{key.rsplit('.', 1)[1]}={v.split(': ')[-1]}" for k, key, _, v in SCALES])
def test_a_zero_negative_or_non_finite_quantization_scale_is_refused(capsys, tmp_path, inputs, state, kind, key,
                                                                     damage, value):
    src = _quantized(kind, state, inputs, key, damage)
    refused(capsys, tmp_path, "convert", src, "--out", tmp_path / "out",
            phrases=(str(src), f"quantization scale {key!r}", value, "nothing was written"))


def test_zero_block_scales_of_nvfp4_are_read(capsys, tmp_path, inputs, state):
    """A block scale of 0 is what a quantizer writes for a block of zeros: read, not refused."""
    src = _quantized("comfy-nvfp4", state, inputs, f"{QKV}.weight_scale", _at(9, _fp8(0.0)))
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "-q")
    assert run.code == 0, run.err


def test_a_nan_code_in_an_fp8_weight_is_refused_where_it_is_dequantized(capsys, tmp_path, inputs, state):
    src = _quantized("bfl-fp8", state, inputs, f"{QKV}.weight", _byte(100, 0x7F))  # e4m3fn NaN
    refused(capsys, tmp_path, "convert", src, "--out", tmp_path / "out",
            phrases=(str(src), f"tensor '{QKV}.weight' once dequantized and rounded to bf16", "NaN"))


def test_dequantized_values_beyond_fp16_are_refused(capsys, tmp_path, inputs, state):
    """Finite scales, finite codes, but the product does not fit the output dtype (`--dtype fp16`)."""
    src = _quantized("bfl-fp8", state, inputs, f"{QKV}.weight_scale", _at(0, 1000.0))
    refused(capsys, tmp_path, "convert", src, "--out", tmp_path / "out", "--dtype", "fp16",
            phrases=(f"tensor '{QKV}.weight' once dequantized and rounded to fp16", "NaN or infinite"))
    assert run_port(capsys, "convert", src, "--out", tmp_path / "ok", "--dtype", "fp32", "-q").code == 0


# --- GGUF: block scales and layout ----------------------------------------------------------------------------------

def _gguf(folder: Path, state, qtype: str = "Q8_0") -> Path:
    path = folder / "model.gguf"
    qf.gguf_file(path, state, qtype)
    return path


def _patch_gguf(path: Path, edit) -> None:
    """Edit tensor infos in place through the gguf package's own (writable) view of the header."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    edit({t.name: t for t in reader.tensors})
    reader.data.flush()
    del reader


def test_a_non_finite_gguf_block_scale_is_refused(capsys, tmp_path, inputs, state):
    import gguf

    path = _gguf(inputs, state)
    start = next(t.data_offset for t in gguf.GGUFReader(path).tensors if t.name == f"{QKV}.weight")
    raw = bytearray(path.read_bytes())
    raw[start + 34 * 5:start + 34 * 5 + 2] = bytes.fromhex("007e")  # block 5's fp16 d: NaN
    path.write_bytes(bytes(raw))
    refused(capsys, tmp_path, "convert", path, "--out", tmp_path / "out",
            phrases=(str(path), f"tensor '{QKV}.weight' once dequantized", "NaN"))


def test_overlapping_gguf_tensors_are_refused(capsys, tmp_path, inputs, state):
    path = _gguf(inputs, state)

    def overlap(tensors):
        a, b = tensors[f"{QKV}.weight"], tensors["double_blocks.0.img_attn.proj.weight"]
        b.field.parts[-1][0] = a.field.parts[-1][0] + 34  # starts inside a's blocks

    _patch_gguf(path, overlap)
    refused(capsys, tmp_path, "convert", path, "--out", tmp_path / "out",
            phrases=(str(path), "header lies about offsets", "tensor 'double_blocks.0.img_attn.proj.weight' starts",
                     f"inside tensor '{QKV}.weight'"))


@pytest.mark.parametrize("qtype, phrase", [
    ("Q4_0", "is declared Q4_0 and holds 6912 bytes"),  # fits the shape, not the bytes it was given
    ("Q4_K", "do not split into Q4_K blocks of 256"),  # rows of 64 values
])
def test_a_gguf_tensor_whose_declared_type_does_not_fit_its_bytes_is_refused(capsys, tmp_path, inputs, state, qtype,
                                                                             phrase):
    import gguf

    path = _gguf(inputs, state)

    def retype(tensors):
        tensors[f"{QKV}.weight"].field.parts[4][0] = int(gguf.GGMLQuantizationType[qtype])

    _patch_gguf(path, retype)
    refused(capsys, tmp_path, "convert", path, "--out", tmp_path / "out",
            phrases=(str(path), f"tensor '{QKV}.weight'", phrase))


def test_a_gguf_vector_of_blocks_reads_whole(tmp_path, state):
    """A 1-D quantized tensor is one row of blocks (its bytes are not divided per element)."""
    import gguf
    import numpy as np

    from porting.tensors.checkpoint import open_checkpoint

    path = tmp_path / "v.gguf"
    data = np.linspace(-1, 1, 96, dtype=np.float32)
    q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    writer = gguf.GGUFWriter(str(path), "flux")
    writer.add_tensor("v", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    want = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(-1).copy())
    ckpt = open_checkpoint(path)
    assert torch.equal(ckpt.read("v"), want)
    assert torch.equal(ckpt.read("v", (10, 40)), want[10:40])


# --- --quantize ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["fp8-scaled", "gguf-q8_0", "gguf-q4_0"])
def test_quantizing_a_layer_that_holds_a_nan_is_refused(capsys, tmp_path, inputs, state, target):
    damaged = {k: v.clone() for k, v in state.items()}
    damaged[f"{QKV}.weight"][3, 4] = NAN
    src = save_state(inputs / "model.safetensors", damaged, torch.bfloat16)
    refused(capsys, tmp_path, "convert", src, "--to", "original", "--quantize", target, "--out", tmp_path / "out",
            phrases=(str(src), f"layer {QKV}.weight", "cannot be quantized", "NaN"))


def test_a_gguf_block_scale_beyond_fp16_is_refused(capsys, tmp_path, inputs, state):
    """Q8_0 stores |largest| / 127 per block as fp16: a float32 value of 1e7 would make that scale infinite."""
    big = {k: v.clone() for k, v in state.items()}
    big[f"{QKV}.weight"][0, 0] = 1e7
    src = save_state(inputs / "model.safetensors", big)
    refused(capsys, tmp_path, "convert", src, "--to", "original", "--quantize", "gguf-q8_0", "--out",
            tmp_path / "out", phrases=(f"layer {QKV}.weight", "Q8_0 stores each block's scale", "fp16"))


# --- JSON: no NaN literal ------------------------------------------------------------------------------------------

def _strict_json(text: str):
    def no_constant(name):
        raise AssertionError(f"{name} literal in JSON output")
    return json.loads(text, parse_constant=no_constant)


def test_json_output_writes_null_for_a_non_finite_number_and_says_so(capsys):
    from porting.cli._output import Output

    Output(json_mode=True).document({"psnr": INF, "rows": [{"err": NAN}, {"err": 0.5}], "n": 3})
    captured = capsys.readouterr()
    doc = _strict_json(captured.out)
    assert doc["psnr"] is None and doc["rows"][0]["err"] is None and doc["rows"][1]["err"] == 0.5
    assert doc["null_means_not_finite"] == ["psnr", "rows[0].err"]
    assert "psnr is not a finite number; written as null" in " ".join(captured.err.split())


def test_manifests_cannot_hold_a_nan_literal():
    from porting.finite import dumps

    doc = _strict_json(dumps({"worst_rel_l2": NAN, "ok": 1.0}))
    assert doc == {"worst_rel_l2": None, "ok": 1.0, "null_means_not_finite": ["worst_rel_l2"]}
    assert math.isfinite(_strict_json(dumps([1e308]))[0])


def test_a_refusal_with_json_is_one_document_without_nan(capsys, tmp_path, inputs, state):
    base = save_state(inputs / "base.safetensors", state)
    adapter = _adapter(inputs, state)
    run = run_port(capsys, "merge", base, f"{adapter}:nan", "--out", tmp_path / "out", "--json")
    assert run.code == 1 and "Traceback" not in run.err
    doc = _strict_json(run.out)
    assert doc["exit_code"] == 1 and "strength is nan" in doc["error"]
    assert leftovers(tmp_path / "out") == []
