"""Nunchaku's 4-bit text encoders read as plain weights: files from deepcompressor's TinyChat writer, every weight
held to an independent decoder of the loaders' arithmetic; damaged files refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from porting.errors import PortError
from porting.tensors.checkpoint import open_checkpoint
from porting.tensors.quant import awq_w4a16

from . import awqfiles as af


@pytest.fixture(scope="module")
def qwen3_file(tmp_path_factory) -> Path:
    return af.write_qwen3_file(tmp_path_factory.mktemp("te") / "svdq-int4-Qwen3-text-Nunchaku.safetensors")


@pytest.fixture(scope="module")
def t5_file(tmp_path_factory) -> Path:
    return af.write_t5_file(tmp_path_factory.mktemp("te") / "awq-int4-flux.1-t5xxl.safetensors")


@pytest.mark.parametrize("which", ["qwen3", "t5"])
def test_every_weight_equals_the_loaders_arithmetic(which, qwen3_file, t5_file):
    path = qwen3_file if which == "qwen3" else t5_file
    stored = load_file(str(path))
    expected = af.oracle_state(stored)
    ckpt = open_checkpoint(path)
    assert ckpt.quantization is not None and ckpt.quantization.format == awq_w4a16.NAME
    assert set(ckpt.tensors) == set(expected)
    quantized = [k for k in expected if k[: -len("weight")] + "qweight" in stored]
    assert len(quantized) == (14 if which == "qwen3" else 14)  # 7 linears a layer (Qwen3); 4 + 3 a block (T5)
    for key, want in expected.items():
        got = ckpt.read(key)
        assert got.shape == want.shape, key
        assert torch.equal(got, want.to(got.dtype)), key  # float32, the same arithmetic: bit-equal
    # a row block reads the same rows (the codes of 4 rows are interleaved per 64 inputs)
    key = quantized[0]
    assert torch.equal(ckpt.read(key, rows=(5, 70)), expected[key][5:70])


def _damaged(tmp_path: Path, src: Path, edit, metadata: dict | None = None) -> Path:
    tensors = load_file(str(src))
    meta = json.loads(json.dumps(_metadata(src)))
    edit(tensors, meta)
    return af.save(tmp_path / "damaged.safetensors", tensors, meta if metadata is None else metadata)


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


KEY = "layers.0.self_attn.q_proj"


def _refused(path: Path, *phrases: str) -> str:
    with pytest.raises(PortError) as err:
        ckpt = open_checkpoint(path)
        for key in ckpt.tensors:
            ckpt.read(key)
    text = str(err.value)
    for phrase in phrases:
        assert phrase in text, text
    return text


def test_a_non_zero_group_pad_is_refused_by_name(tmp_path, qwen3_file):
    def edit(t, meta):
        t[KEY + ".scales"][3, 7] = 0.5  # k = 128 in groups of 128: one group, rows 1..7 are the writer's pad
    _refused(_damaged(tmp_path, qwen3_file, edit), f"{KEY}.scales", "group row 3", "pads those rows with zeros")


def test_codes_and_scales_that_disagree_are_refused_by_name(tmp_path, qwen3_file):
    def edit(t, meta):
        t[KEY + ".scaled_zeros"] = t[KEY + ".scaled_zeros"][:, :-4].contiguous()
    _refused(_damaged(tmp_path, qwen3_file, edit), f"{KEY}.qweight", "scaled_zeros is BF16 [8, 124]",
             "need 16-bit [8, 128]")


def test_a_group_size_the_layout_does_not_allow_is_refused(tmp_path, qwen3_file):
    def edit(t, meta):
        meta["quantization_config"] = json.dumps({"weight": {"group_size": 96}})
    _refused(_damaged(tmp_path, qwen3_file, edit), "group_size 96", "groups of 32, 64, 128 only")


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path, qwen3_file):
    def edit(t, meta):
        meta["quantization_config"] = json.dumps({"weight": {"group_size": 64}})
    _refused(_damaged(tmp_path, qwen3_file, edit), "AWQ W4A16 int4 g64", "scales is BF16 [8, 128]",
             "groups of 64 need 16-bit [16, 128]")


def test_a_scale_without_its_codes_is_refused(tmp_path, qwen3_file):
    def edit(t, meta):
        t["layers.1.mlp.up_proj.scales_copy.scales"] = t[KEY + ".scales"].clone()
    _refused(_damaged(tmp_path, qwen3_file, edit), "layers.1.mlp.up_proj.scales_copy.scales", "no 4-bit qweight")


def test_a_nan_scale_is_refused(tmp_path, qwen3_file):
    def edit(t, meta):
        t[KEY + ".scales"][0, 2] = float("nan")
    _refused(_damaged(tmp_path, qwen3_file, edit), f"{KEY}.scales", "NaN")


@pytest.mark.parametrize("which", ["qwen3", "t5"])
def test_convert_writes_a_folder_its_class_loads_with_the_loaders_numbers(which, qwen3_file, t5_file, tmp_path):
    import transformers

    from porting.engine.text_encoder import convert_text_encoder

    path = qwen3_file if which == "qwen3" else t5_file
    result = convert_text_encoder(path, tmp_path / "te")
    assert result.ok and result.files == ["model.safetensors"]
    cls = transformers.Qwen3Model if which == "qwen3" else transformers.T5EncoderModel
    model, info = cls.from_pretrained(tmp_path / "te", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    expected = af.oracle_state(load_file(str(path)))
    state = model.state_dict()
    for key, want in expected.items():
        assert torch.equal(state[key], want.to(torch.bfloat16)), key  # float32 arithmetic, rounded once to bf16
    assert model.dtype == torch.bfloat16


def test_an_opened_text_encoder_says_what_it_is_and_refuses_transformer_verbs(qwen3_file):
    from porting.inputs import open_source

    source = open_source(qwen3_file)
    assert source.kind == "text_encoder"
    te = source.text_encoder
    assert te.architecture.model_class == "Qwen3Model" and te.layers == 2 and te.group == 128
    assert len(te.quantized) == 14 and "layers.1.mlp.down_proj" in te.quantized
    with pytest.raises(PortError) as err:
        source.detection
    assert "not a diffusion transformer" in str(err.value) and "port convert" in err.value.hint


def test_strict_accounts_for_every_tensor_of_the_architecture(tmp_path, qwen3_file):
    from porting.engine.text_encoder import convert_text_encoder
    from porting.errors import PlanError

    def edit(t, meta):
        del t["layers.1.post_attention_layernorm.weight"]
    damaged = _damaged(tmp_path, qwen3_file, edit)
    with pytest.raises(PlanError) as err:
        convert_text_encoder(damaged, tmp_path / "out")
    assert "1 missing" in str(err.value) and "layers.1.post_attention_layernorm.weight" in str(err.value)
    assert not (tmp_path / "out").exists()
    result = convert_text_encoder(damaged, tmp_path / "out", strict=False)
    assert result.missing == [("layers.1.post_attention_layernorm.weight", (128,))]


@pytest.mark.parametrize("field, value, phrase", [
    ("hidden_size", 256, "hidden_size = 256"),
    ("num_hidden_layers", 3, "num_hidden_layers = 3, the file holds 2 layer(s) (layer 2 missing)")])
def test_a_config_that_contradicts_the_tensors_is_refused(tmp_path, qwen3_file, field, value, phrase):
    from porting.inputs import open_source

    def edit(t, meta):
        cfg = json.loads(meta["config"])
        cfg[field] = value
        meta["config"] = json.dumps(cfg)
    with pytest.raises(PortError) as err:
        open_source(_damaged(tmp_path, qwen3_file, edit)).text_encoder
    text = str(err.value)
    assert phrase in text and ("contradicts the tensors" in text or "loaders build every layer" in text), text
