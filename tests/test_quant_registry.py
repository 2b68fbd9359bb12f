"""The quantized layouts are one registry (`porting/tensors/quant/registry.py`): a new layout is a module with one
`Layout` declaration and one line in `LAYOUTS`. A layout defined here, in the test, and appended to the registry is
recognised by open, inspect and convert, and its sidecars count as sidecars, with no other edit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from porting.tensors.checkpoint import open_checkpoint
from porting.tensors.quant import awq_w4a16, registry
from porting.tensors.quant.base import Found, Layout, Scaled, layer_parts
from porting.tensors.reader import Checkpoint
from porting.tensors.sidecars import is_sidecar, may_be_quantized

from . import quantfiles as qf
from .helpers import TINY2, leftovers, reference_model, run_port

# ---- a layout of its own, as a new module would declare it: int8 weights, a per-row `fake_scale`, one marker ----
FAKE_NAME = "Fake int8 (per-row fake_scale)"
FAKE_MARKER = "fake_quant"
FAKE_SCHEME = Scaled("int8 x fake_scale (per row)", scale_role="fake_scale", per_row=True, weight_dtypes=("I8",))


def fake_find(ckpt: Checkpoint) -> Found:
    found = Found(FAKE_NAME, consumed={k for k in ckpt.tensors if k.rsplit(".", 1)[-1] == FAKE_MARKER})
    for key in ckpt.tensors:
        if key.endswith(".fake_scale"):
            layer_parts(ckpt, key[: -len("fake_scale")], FAKE_SCHEME, found, where=FAKE_NAME)
    return found


FAKE = Layout(FAKE_NAME, sidecars=(FAKE_MARKER, "fake_scale"), markers=(FAKE_MARKER,), find=fake_find)
# ----

PROJ = "double_blocks.0.img_attn.proj.weight"  # diffusers: transformer_blocks.0.attn.to_out.0.weight


@pytest.fixture
def fake_layout():
    """The layout above in the registry for one test, through its public list."""
    registry.LAYOUTS.append(FAKE)
    try:
        yield FAKE
    finally:
        registry.LAYOUTS.remove(FAKE)


@pytest.fixture(scope="module")
def fake_file(tmp_path_factory):
    """The block linears of a tiny FLUX.2 in the fake layout, and the oracle (int8 x scale, float32)."""
    state = reference_model(TINY2, seed=9).state_dict()
    tensors, oracle = {}, {}
    quantized = set(qf.block_linears(state))
    for key, w in state.items():
        if key in quantized:
            scale = w.float().abs().amax(dim=1).clamp_min(1e-8) / 127
            q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
            tensors[key], tensors[key[: -len("weight")] + "fake_scale"] = q, scale
            oracle[key] = q.float() * scale[:, None]
        else:
            tensors[key], oracle[key] = w, w.float()
    tensors[FAKE_MARKER] = torch.empty(0, dtype=torch.uint8)
    return qf.save(tmp_path_factory.mktemp("fake") / "fake-int8.safetensors", tensors), oracle, len(quantized)


def test_a_registered_layout_is_opened_inspected_and_converted(fake_layout, fake_file, tmp_path, capsys):
    path, oracle, layers = fake_file
    ckpt = open_checkpoint(path)
    assert ckpt.quantization is not None and ckpt.quantization.format == FAKE_NAME
    assert ckpt.tensors[PROJ].computed and torch.equal(ckpt.read(PROJ), oracle[PROJ])
    assert not any(is_sidecar(k) for k in ckpt.tensors)  # marker and scales folded into the weights
    run = run_port(capsys, "inspect", path, "--json")
    assert run.code == 0, run.err
    q = json.loads(run.out)["quantization"]
    assert q["format"] == FAKE_NAME and q["dequantized_tensors"] == layers
    assert q["layers"] == {FAKE_SCHEME.name: layers} and q["folded"] == layers + 1  # the scales and the marker
    run = run_port(capsys, "convert", path, "--out", tmp_path / "out", "--dtype", "fp32", "-q")
    assert run.code == 0, run.err
    from safetensors.torch import load_file

    out = load_file(str(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(out["transformer_blocks.0.attn.to_out.0.weight"], oracle[PROJ])


def test_a_registered_layouts_sidecars_are_sidecars_and_never_dropped_without_its_marker(fake_file, tmp_path, capsys,
                                                                                       request):
    assert not is_sidecar("a.fake_scale") and not may_be_quantized(["a.weight", "a.fake_scale"], {})
    request.getfixturevalue("fake_layout")
    assert is_sidecar("a.fake_scale") and is_sidecar("fake_quant")
    assert may_be_quantized(["a.weight", "a.fake_scale"], {})
    from safetensors.torch import load_file

    tensors = load_file(str(fake_file[0]))
    del tensors[FAKE_MARKER]  # scales without the marker: no layout is declared
    src = qf.save(tmp_path / "unmarked.safetensors", tensors)
    assert open_checkpoint(src).quantization is None
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--no-strict")
    assert run.code == 1 and "quantization tensor(s) are not part of any layout" in run.msg, run.msg
    assert ".fake_scale" in run.msg and leftovers(tmp_path / "out") == []


def test_the_registry_gives_the_lists_once_written_by_hand():
    assert registry.sidecar_names() == {
        "scale_weight", "scale_input", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale",
        "comfy_quant", "scaled_fp8", "qweight", "qzeros", "wscales", "wzeros", "smooth_factor", "smooth_orig",
        "smooth_factor_orig", "proj_down", "proj_up", "wtscale", "wcscales",
        "scales", "scaled_zeros"}  # the 4-bit text encoders' AWQ W4A16 layout, the first one added through it
    assert registry.metadata_keys() == {"_quantization_metadata"}
    assert [m.name for m in registry.refused()] == ["AWQ / GPTQ (packed int4 with zero points)"]
    assert [m.name for m in registry.declared()] == ["ComfyUI mixed precision", "ComfyUI scaled fp8",
                                                     "Nunchaku SVDQuant", "Nunchaku Lite (diffusers)",
                                                     awq_w4a16.NAME]
    assert [m.name for m in registry.by_sidecars()] == ["BFL-scheme quantized",
                                                        "ModelOpt int8 (per-channel weight_scale)"]
    refused = registry.refused_formats()
    assert refused["ComfyUI mixed precision", "convrot_w4a4"] == "ConvRot W4A4 (Hadamard-rotated int4)"
    assert ("AWQ / GPTQ (packed int4 with zero points)",) * 2 in refused and len(refused) == 6


def test_every_refused_format_is_in_the_docs():
    """A format the registry refuses by name is listed in docs/quantized.md (a new refusal is documented)."""
    doc = (Path(__file__).parents[1] / "docs" / "quantized.md").read_text()
    for (layout, fmt), what in registry.refused_formats().items():
        if fmt == layout:  # a whole layout: its name and marker keys
            declared = next(m for m in registry.LAYOUTS if m.name == layout)
            assert what.split(" (")[0] in doc and all(f"`{k}`" in doc for k in declared.markers), layout
        else:
            assert f"`{fmt}`" in doc, (layout, fmt)


def test_awq_gptq_is_refused_by_name(tmp_path, capsys):
    state = reference_model(TINY2, seed=9).state_dict()
    w = state.pop(PROJ)
    layer = PROJ[: -len("weight")]
    state[layer + "qweight"] = torch.zeros(w.shape[1], w.shape[0] // 8, dtype=torch.int32)
    state[layer + "qzeros"] = torch.zeros(w.shape[1] // 128, w.shape[0] // 8, dtype=torch.int32)
    state[layer + "scales"] = torch.ones(w.shape[1] // 128, w.shape[0], dtype=torch.float16)
    src = qf.save(tmp_path / "awq.safetensors", state)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out")
    assert run.code == 1, run.msg
    assert (f"quantized as AWQ / GPTQ (packed int4 with zero points) (e.g. {layer + 'qweight'!r}); flux-port "
            "refuses it: it cannot turn this layout into plain weights exactly. Nothing was written.") in run.msg
    assert leftovers(tmp_path / "out") == []


def test_a_declaration_says_how_it_is_recognised_and_decoded():
    with pytest.raises(TypeError, match="exactly one of find or view"):
        Layout("no decoder", sidecars=("x",), markers=("x",))
    with pytest.raises(TypeError, match="markers, metadata_keys or recognise"):
        Layout("unrecognisable", sidecars=("x",), find=fake_find)
    with pytest.raises(TypeError, match="give the markers that name it"):
        Layout("refused", sidecars=("x",), recognise=lambda ckpt: False, refused=True)
