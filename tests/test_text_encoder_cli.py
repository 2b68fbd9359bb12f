"""The 4-bit text encoders through the verbs: inspect says what the file is and who loads it, convert writes it
4-bit and back to bf16, options that do not apply are refused (exit 2) and transformer verbs say what to run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import awqfiles as af
from .helpers import run_port


@pytest.fixture(scope="module")
def te_folder(tmp_path_factory) -> Path:
    from porting.demo.tiny import write_random_text_encoder

    cfg = {k: v for k, v in af.TINY_QWEN3.items() if k != "rope_theta"}
    return write_random_text_encoder(tmp_path_factory.mktemp("cli") / "text_encoder", cfg, seed=7)


def test_convert_to_4_bit_inspect_and_back_to_bf16(te_folder, tmp_path, capsys):
    run = run_port(capsys, "convert", te_folder, "--quantize", "awq-int4", "--out", tmp_path / "q", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["to"] == "awq-int4" and doc["quantized_layers"] == 14 and doc["dropped"] == ["lm_head.weight"]
    file = tmp_path / "q" / doc["file"]
    run = run_port(capsys, "inspect", file, "--json")
    assert run.code == 0, run.err
    info = json.loads(run.out)
    assert info["kind"] == "text_encoder" and info["model_class"] == "Qwen3Model" and info["layers"] == 2
    assert info["four_bit"]["group_size"] == 128 and info["four_bit"]["layers"] == 14
    assert any("NunchakuQwenEncoderModel" in who for who in info["loaded_by"])
    run = run_port(capsys, "inspect", file)
    assert run.code == 0 and "AWQ W4A16 (TinyChat layout), group 128" in run.out
    run = run_port(capsys, "convert", file, "--out", tmp_path / "bf16", "--json")
    assert run.code == 0, run.err
    back = json.loads(run.out)
    assert back["ok"] and back["architecture"] == "Qwen3Model" and back["quantized_layers"] == 14
    assert (tmp_path / "bf16" / "config.json").is_file() and (tmp_path / "bf16" / "model.safetensors").is_file()
    # a bf16 folder is a text encoder too: inspect says which class loads it
    run = run_port(capsys, "inspect", te_folder, "--json")
    assert run.code == 0 and json.loads(run.out)["loaded_by"] == ["transformers Qwen3ForCausalLM.from_pretrained"]


@pytest.mark.parametrize("args, phrase", [
    (["--to", "original"], "--to applies to transformer weights"),
    (["--dtype", "fp16"], "a text encoder is written in bf16"),
    (["--quantize", "svdq-int4"], "is a text encoder; the transformer formats do not apply"),
    (["--quantize", "awq-int4", "--rank", "16"], "--rank applies to --quantize svdq-int4 / svdq-nvfp4 only"),
])
def test_options_that_do_not_apply_to_a_text_encoder_are_refused(te_folder, tmp_path, capsys, args, phrase):
    run = run_port(capsys, "convert", te_folder, "--out", tmp_path / "out", *args)
    assert run.code == 2 and phrase in run.msg, run.err
    assert not (tmp_path / "out").exists()


def test_a_transformer_is_not_quantized_as_a_text_encoder_and_a_text_encoder_not_validated(tmp_path, capsys,
                                                                                          tiny2_file, te_folder):
    run = run_port(capsys, "convert", tiny2_file, "--quantize", "awq-int4", "--out", tmp_path / "out")
    assert run.code == 2 and "writes a 4-bit text encoder" in run.msg and "svdq-int4" in run.err
    file = af.write_qwen3_file(tmp_path / "svdq-int4-Qwen3-text-Nunchaku.safetensors")
    run = run_port(capsys, "validate", file)
    assert run.code == 2 and "not a diffusion transformer" in run.msg and f"port convert {file}" in run.msg
