"""`port convert --to original --quantize ...`: files in the layouts ComfyUI / ComfyUI-GGUF read, checked by their
own readers (the gguf package, plain safetensors), with the dequantized error reported from a reread."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from .helpers import TINY2, leftovers, reference_model, run_port, save_state
from .reference.flux2_bfl import Flux2Reference
from .test_equivalence import flux2_inputs, load_strict, run_flux2_pair

QUANTIZED = {"double_blocks.0.img_attn.qkv.weight", "single_blocks.1.linear2.weight",
             "double_stream_modulation_img.lin.weight"}
KEPT = {"img_in.weight", "txt_in.weight", "final_layer.linear.weight"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    state = reference_model(TINY2, seed=8).state_dict()
    path = save_state(tmp_path_factory.mktemp("src") / "klein-tiny.safetensors", state, torch.bfloat16)
    return path, {k: v.to(torch.bfloat16).float() for k, v in state.items()}


def rel_l2(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _quantize(capsys, src, out, target):
    run = run_port(capsys, "convert", src, "--to", "original", "--quantize", target, "--out", out, "--json", "-q")
    assert run.code == 0, run.err
    return json.loads(run.out)


def _forward_matches(tmp_path, capsys, file, oracle):
    """Converting the quantized file back to diffusers computes the reference forward with `oracle` weights."""
    back = tmp_path / "back"
    run = run_port(capsys, "convert", file, "--out", back, "--strict", "--dtype", "fp32", "-q")
    assert run.code == 0, run.err
    from diffusers import Flux2Transformer2DModel

    expected = Flux2Reference(TINY2)
    expected.load_state_dict(oracle, strict=True)
    ref, got = run_flux2_pair(expected.eval(), load_strict(Flux2Transformer2DModel, back), flux2_inputs(TINY2))
    assert rel_l2(got, ref) < 1e-5


@pytest.mark.parametrize("target, qtype", [("gguf-q8_0", "Q8_0"), ("gguf-q4_0", "Q4_0")])
def test_gguf_out_is_what_comfyui_gguf_reads(tmp_path, capsys, source, target, qtype):
    import gguf

    src, meant = source
    doc = _quantize(capsys, src, tmp_path / "out", target)
    file = tmp_path / "out" / doc["file"]
    reader = gguf.GGUFReader(file)  # the package's own reader, not flux-port's
    assert reader.get_field("general.architecture").contents() == "flux"
    by_name = {t.name: t for t in reader.tensors}
    assert set(by_name) == set(meant)  # BFL names, no prefix
    oracle, worst = {}, 0.0
    for name, t in by_name.items():
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        oracle[name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(meant[name].shape)
        if name in QUANTIZED:
            assert t.tensor_type.name == qtype, name
        if name in KEPT or meant[name].ndim == 1:
            assert t.tensor_type.name in ("BF16", "F32") and torch.equal(oracle[name], meant[name]), name
        worst = max(worst, rel_l2(oracle[name], meant[name]))
    reread = doc["reread"]
    assert reread["worst_rel_l2"] == pytest.approx(worst, rel=1e-4) and worst > 0
    assert doc["stored_kinds"][qtype] == 23
    manifest = json.loads((tmp_path / "out" / "flux-port.json").read_text())
    assert manifest["quantized_to"] == f"GGUF {qtype}" and manifest["reread"]["worst_key"] == reread["worst_key"]
    _forward_matches(tmp_path, capsys, file, oracle)


def test_fp8_scaled_out_is_comfyuis_legacy_layout(tmp_path, capsys, source):
    src, meant = source
    doc = _quantize(capsys, src, tmp_path / "out", "fp8-scaled")
    file = tmp_path / "out" / doc["file"]
    stored = load_file(str(file))
    prefix = "model.diffusion_model."
    marker = stored.pop(prefix + "scaled_fp8")
    assert marker.dtype == torch.float8_e4m3fn and marker.numel() == 0  # declares e4m3fn, fp8 matmuls allowed
    assert prefix + "double_stream_modulation_img.lin.weight" in stored  # how ComfyUI recognises FLUX.2
    oracle, worst = {}, 0.0
    for key in meant:
        w = stored[prefix + key]
        scale = stored.get(prefix + key[: -len("weight")] + "scale_weight")
        if key in QUANTIZED:
            assert w.dtype == torch.float8_e4m3fn and scale is not None and scale.shape == ()
        if key in KEPT:
            assert w.dtype == torch.bfloat16 and scale is None
        oracle[key] = w.float() * scale if scale is not None else w.float()  # convert_old_quants' arithmetic
        worst = max(worst, rel_l2(oracle[key], meant[key]))
    assert 0.01 < worst < 0.05 and doc["reread"]["worst_rel_l2"] == pytest.approx(worst, rel=1e-4)
    assert doc["reread"]["layout"].startswith("ComfyUI scaled fp8")
    _forward_matches(tmp_path, capsys, file, oracle)


def test_quantize_from_a_diffusers_folder_writes_bfl_names(tmp_path, capsys, source):
    import gguf

    src, meant = source
    assert run_port(capsys, "convert", src, "--out", tmp_path / "transformer", "-q").code == 0
    doc = _quantize(capsys, tmp_path / "transformer", tmp_path / "gguf", "gguf-q8_0")
    names = {t.name for t in gguf.GGUFReader(tmp_path / "gguf" / doc["file"]).tensors}
    assert names == set(meant)


def test_quantize_needs_original_naming(tmp_path, capsys, source):
    run = run_port(capsys, "convert", source[0], "--quantize", "gguf-q8_0", "--out", tmp_path / "out")
    assert run.code == 2 and "needs --to original" in run.msg
    assert leftovers(tmp_path / "out") == []
