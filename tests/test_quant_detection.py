"""Which quantized layout a file is follows from its header, never from a guess; what cannot be read exactly is
refused by name; scales are never dropped silently; inspect and validate see the quantization."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from porting.tensors.checkpoint import open_checkpoint, read_header
from porting.tensors.quant import bfl_scheme, comfy_mixed
from porting.tensors.quant.base import NVFP4, Parts
from porting.tensors.reader import Checkpoint

from . import quantfiles as qf
from .helpers import TINY2, leftovers, reference_model, run_port

NVFP4_KEY = "single_blocks.0.linear1.weight"  # [576, 64]: 576 rows are not a multiple of 128 (padded scale tiles)


@pytest.fixture(scope="module")
def state():
    return reference_model(TINY2, seed=6).state_dict()


@pytest.fixture(scope="module")
def comfy_nvfp4(state, tmp_path_factory):
    tensors, oracle, meta = qf.comfy_mixed(state, "nvfp4")
    return qf.save(tmp_path_factory.mktemp("q") / "comfy-nvfp4.safetensors", tensors, meta), oracle


@pytest.fixture(scope="module")
def bfl_nvfp4(state, tmp_path_factory):
    tensors, oracle = qf.diffusers_bfl(state)
    return qf.save(tmp_path_factory.mktemp("q") / "bfl-nvfp4.safetensors", tensors), oracle


def rel_l2(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _raw(path) -> Checkpoint:
    tensors, metadata = read_header(path)
    return Checkpoint(path, tensors, [path], metadata=metadata)


def _read_as(path, key: str, scheme: NVFP4) -> torch.Tensor:
    """The bytes of `key` dequantized with a scheme forced by hand (what a guessing reader would do)."""
    raw = _raw(path)
    layer = key[: -len("weight")]
    from porting.tensors.quant.base import Layer

    parts = {"weight": raw.tensors[key], "weight_scale": raw.tensors[layer + "weight_scale"],
             "weight_scale_2": raw.tensors[layer + "weight_scale_2"]}
    n = raw.tensors[key].shape[0]
    return scheme.dequantize(Parts(Layer(key, scheme, parts), {}), (0, n))


def test_comfy_nvfp4_is_read_as_comfy_although_it_also_has_bfl_style_weight_scales(comfy_nvfp4):
    path, oracle = comfy_nvfp4
    assert bfl_scheme.claims(_raw(path))  # weight_scale next to a uint8 weight: the BFL layout would take it
    ckpt = open_checkpoint(path)
    assert ckpt.quantization.format == "ComfyUI mixed precision"  # the comfy_quant markers decide
    assert torch.equal(ckpt.read(NVFP4_KEY), oracle[NVFP4_KEY])
    # the BFL nibble order on these bytes (scales still unswizzled correctly): no error raised, weights far off
    wrong = _read_as(path, NVFP4_KEY, NVFP4("forced", high_first=False, swizzled=True))
    assert rel_l2(wrong, oracle[NVFP4_KEY]) > 0.5


def test_bfl_nvfp4_is_read_as_bfl_and_never_as_comfy(bfl_nvfp4):
    path, oracle = bfl_nvfp4
    assert not comfy_mixed.claims(_raw(path))  # no marker: the ComfyUI layout never applies
    ckpt = open_checkpoint(path)
    assert ckpt.quantization.format == "diffusers BFL scheme (fp8r / nvfp4)"
    assert torch.equal(ckpt.read(NVFP4_KEY), oracle[NVFP4_KEY])
    # the ComfyUI nibble order on these bytes: silently wrong, which is why only a marker may select it
    wrong = _read_as(path, NVFP4_KEY, NVFP4("forced", high_first=True, swizzled=False))
    assert rel_l2(wrong, oracle[NVFP4_KEY]) > 0.5


def test_bfl_nvfp4_bytes_under_a_comfy_marker_are_refused_not_misread(bfl_nvfp4, tmp_path, capsys):
    """A lying marker: row-major [576, 4] scales cannot be ComfyUI's swizzled tiles ([640, 4]); refused by shape."""
    from safetensors.torch import load_file

    tensors = load_file(str(bfl_nvfp4[0]))
    tensors[NVFP4_KEY[: -len(".weight")] + ".comfy_quant"] = qf.json_tensor({"format": "nvfp4"})
    src = qf.save(tmp_path / "lying.safetensors", tensors)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--strict")
    assert run.code == 2 and "do not fit swizzled, padded to 128 x 4 tiles scales [640, 4]" in run.msg, run.msg
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("fmt, named", [("convrot_w4a4", "ConvRot"), ("awq_w4a16", "AWQ"),
                                        ("svdquant_w4a4", "SVDQuant"), ("nf4_magic", "unknown format 'nf4_magic'")])
def test_unsupported_comfy_formats_are_refused_by_name(state, tmp_path, capsys, fmt, named):
    tensors, _, _ = qf.comfy_mixed(state, "float8_e4m3fn")
    tensors["double_blocks.1.img_attn.proj.comfy_quant"] = qf.json_tensor({"format": fmt, "group_size": 64})
    src = qf.save(tmp_path / "odd.safetensors", tensors)
    out = tmp_path / "out"
    run = run_port(capsys, "convert", src, "--out", out, "--no-strict", "--json")
    assert run.code == 1, run.err
    doc = json.loads(run.out)
    assert named in doc["error"] and fmt in doc["error"] and "Nothing was written" in doc["error"]
    assert "double_blocks.1.img_attn.proj" in doc["error"]
    assert leftovers(out) == []


def test_svdquant_keys_are_refused_by_name(state, tmp_path, capsys):
    tensors = {k: v for k, v in state.items()}
    w = tensors.pop("double_blocks.0.img_attn.qkv.weight")
    tensors["double_blocks.0.img_attn.qkv.qweight"] = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32)
    tensors["double_blocks.0.img_attn.qkv.wscales"] = torch.ones(w.shape[1] // 64, w.shape[0])
    src = qf.save(tmp_path / "svdq_r32-klein.safetensors", tensors)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out")
    assert run.code == 1 and "Nunchaku SVDQuant" in run.msg and "Nothing was written" in run.msg
    assert "double_blocks.0.img_attn.qkv" in run.msg
    assert leftovers(tmp_path / "out") == []


def test_no_strict_never_drops_scales_and_writes_raw_fp8(state, tmp_path, capsys):
    """The old silent bug: a scale without its layout marker, converted with --no-strict, used to be dropped and
    the raw fp8 values written as the weight."""
    tensors, _ = qf.comfy_scaled_fp8(state, prefix="")
    del tensors["scaled_fp8"]  # scales without the marker: no layout is declared
    src = qf.save(tmp_path / "unmarked.safetensors", tensors)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--no-strict")
    assert run.code == 1 and "quantization tensor(s) are not part of any layout" in run.msg, run.msg
    assert "with or without --strict" in run.msg and leftovers(tmp_path / "out") == []
    # and with the marker, --no-strict dequantizes (the written weight is weight * scale, not the raw fp8)
    marked, oracle = qf.comfy_scaled_fp8(state, prefix="")
    src = qf.save(tmp_path / "marked.safetensors", marked)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "ok", "--no-strict", "--dtype", "fp32", "-q")
    assert run.code == 0, run.err
    from safetensors.torch import load_file

    out = load_file(str(tmp_path / "ok" / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(out["transformer_blocks.0.attn.to_out.0.weight"], oracle["double_blocks.0.img_attn.proj.weight"])


def test_inspect_shows_format_counts_and_what_is_dropped(comfy_nvfp4, capsys):
    path, _ = comfy_nvfp4
    run = run_port(capsys, "inspect", path, "--json")
    assert run.code == 0, run.err
    q = json.loads(run.out)["quantization"]
    assert q["format"] == "ComfyUI mixed precision" and q["dequantized_tensors"] == 20
    assert q["layers"] == {"nvfp4 (ComfyUI: high nibble first, swizzled scales)": 20}
    assert len(q["dropped"]) == 20 and all(k.endswith(".input_scale") for k in q["dropped"])
    assert q["folded"] == 60  # weight_scale, weight_scale_2 and comfy_quant of 20 layers
    run = run_port(capsys, "inspect", path)
    assert "ComfyUI mixed precision" in run.out and "dropped" in run.out and "input_scale" in run.out


def test_inspect_shows_gguf_types(state, tmp_path, capsys):
    path = tmp_path / "klein.gguf"
    qf.gguf_file(path, state, "Q8_0")
    run = run_port(capsys, "inspect", path, "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["container"] == "gguf" and doc["family"] == "flux2" and doc["quantization"]["layers"] == {"Q8_0": 20}
    assert "general.architecture = 'flux'" in doc["quantization"]["notes"]


def test_validate_reads_a_quantized_file_directly_golden_is_the_dequantized_float32(comfy_nvfp4, tmp_path):
    from porting.engine.convert import convert
    from validation.api import validate
    from validation.report import to_markdown
    from validation.weights import WeightSource

    path, _ = comfy_nvfp4
    direct = WeightSource(path)
    converted = WeightSource(convert(path, tmp_path / "fp32", dtype="fp32").out)
    assert set(direct.keys()) == set(converted.keys())
    for key in direct.keys():  # what every run of validate loads: the dequantized weights in float32
        a, b = direct.get(key), converted.get(key)
        assert a.dtype == torch.float32 and torch.equal(a, b), key
    report = validate(path, resolution=64, text_len=16, timesteps=(1.0,))
    d = report.to_dict()
    assert d["verdict"] == "pass" and d["model"]["dequantized_from"].startswith("ComfyUI mixed precision")
    assert "dequantized from ComfyUI mixed precision" in to_markdown(d)
    # a folder converted from it says where it came from too
    via_folder = validate(convert(path, tmp_path / "bf16").out, resolution=64, text_len=16, timesteps=(1.0,))
    assert via_folder.to_dict()["model"]["dequantized_from"] == d["model"]["dequantized_from"]


def test_plain_files_are_untouched_by_the_quantized_readers(tiny2_file):
    ckpt = open_checkpoint(tiny2_file)
    assert ckpt.quantization is None and ckpt.stored is None and not any(t.computed for t in ckpt.tensors.values())


def test_every_tensor_and_engine_module_imports_on_its_own():
    """No import cycles in tensor I/O and the engine: each module imported first, all porting modules unloaded
    in between (one interpreter, so torch loads once)."""
    import pkgutil

    import porting.engine
    import porting.tensors

    names = [m.name for pkg in (porting.tensors, porting.engine)
             for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    assert "porting.tensors.identity" in names and "porting.tensors.quant.comfy_mixed" in names
    assert "porting.engine.quantize" in names
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    for m in [m for m in sys.modules if m.startswith(('porting', 'validation'))]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_metadata_contradicting_a_comfy_quant_tensor_is_refused(state, tmp_path, capsys):
    """A layer declared twice (header `_quantization_metadata` and its `comfy_quant` tensor) with two formats: the
    file is refused naming the layer, not read by whichever declaration came last (issue 29 rule 4)."""
    tensors, _, _ = qf.comfy_mixed(state, "float8_e4m3fn", declare="tensor")
    layer = next(k[: -len(".comfy_quant")] for k in sorted(tensors) if k.endswith(".comfy_quant"))
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                      "layers": {layer: {"format": "int8_tensorwise"}}})}
    src = qf.save(tmp_path / "twice.safetensors", tensors, metadata)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--json")
    assert run.code == 2, run.err
    error = json.loads(run.out)["error"]
    assert layer in error and "float8_e4m3fn" in error and "int8_tensorwise" in error
    assert leftovers(tmp_path / "out") == []


def test_a_scale_vector_of_the_wrong_length_is_named_as_such(state, tmp_path, capsys):
    """The true reason (issue 29 rule 5): a per-row scale with too few values, not a shape that 'fits neither'."""
    tensors, _ = qf.comfy_scaled_fp8(state, prefix="")
    key = next(k for k in sorted(tensors) if k.endswith(".scale_weight"))
    rows = tensors[key[: -len("scale_weight")] + "weight"].shape[0]
    tensors[key] = torch.ones(rows - 1)
    src = qf.save(tmp_path / "short-scale.safetensors", tensors)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--json")
    assert run.code == 2, run.err
    error = json.loads(run.out)["error"]
    assert f"the scale has {rows - 1} values" in error and f"needs {rows} values" in error


def test_a_prefix_on_only_some_keys_is_named_as_such(state, tmp_path, capsys):
    """The true reason (issue 29 rule 5): keys without the prefix the rest carry are there, not missing."""
    keys = sorted(state)
    tensors = {("model.diffusion_model." + k if i % 2 == 0 or "modulation" in k or k.startswith("img_in") else k): v
               for i, (k, v) in enumerate((k, state[k]) for k in keys)}
    stray = next(k for k in tensors if not k.startswith("model.diffusion_model."))
    src = qf.save(tmp_path / "half-prefixed.safetensors", tensors)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--json")
    assert run.code == 2, run.err
    error = json.loads(run.out)["error"]
    assert "'model.diffusion_model.'" in error and stray in error and "missing" not in error
    assert leftovers(tmp_path / "out") == []
