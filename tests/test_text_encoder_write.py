"""`port convert TE_FOLDER --quantize awq-int4`: the file re-read by an independent decoder of the loaders'
arithmetic, its bytes equal to deepcompressor's TinyChat writer given the same scales and zeros, its keys what the
loaders build, its metadata what they read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from porting.engine.awq_quantize import quantize_text_encoder
from porting.engine.text_encoder import convert_text_encoder

from . import awqfiles as af


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    from porting.demo.tiny import write_random_text_encoder

    cfg = {k: v for k, v in af.TINY_QWEN3.items() if k != "rope_theta"}
    return write_random_text_encoder(tmp_path_factory.mktemp("qwen3") / "text_encoder", cfg, seed=3)


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("t5") / "text_encoder_2"
    af.t5_model(seed=4).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _source_weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("which", ["qwen3", "t5"])
def test_the_written_file_decodes_near_the_source_and_matches_the_reference_writer(which, qwen3_folder, t5_folder,
                                                                                   tmp_path):
    folder = qwen3_folder if which == "qwen3" else t5_folder
    result = quantize_text_encoder(folder, tmp_path / "q")
    path = tmp_path / "q" / result.file
    assert result.file.startswith("awq-int4-") and path.is_file()
    stored = load_file(str(path))
    decoded = af.oracle_state(stored)
    source = _source_weights(folder)
    prefix = "model." if which == "qwen3" else ""
    assert result.dropped == (["lm_head.weight"] if which == "qwen3" else [])
    assert set(decoded) == {k[len(prefix):] for k in source if k.startswith(prefix)}
    worst = 0.0
    for key, got in decoded.items():
        want = source[prefix + key].float()
        if key[: -len("weight")] + "qweight" not in stored:
            assert torch.equal(got.float(), want), key  # copied as stored
            continue
        scales = stored[key[: -len("weight")] + "scales"][: want.shape[1] // 128].float()
        step = scales.t().repeat_interleave(128, dim=1)
        assert bool(((got - want).abs() <= step / 2 + 1e-2 * step + 1e-6).all()), key  # within half a step
        worst = max(worst, float((got - want).norm() / want.norm()))
        # deepcompressor's writer, given the same scale and zero point, writes the same bytes
        base = key[: -len("weight")]
        zero = -stored[base + "scaled_zeros"][: want.shape[1] // 128].t()
        ref = af.tinychat.convert_to_tinychat_w4x16y16_linear_weight(
            source[prefix + key].to(torch.bfloat16), scale=scales.t().to(torch.bfloat16).contiguous(),
            zero=zero.contiguous(), zero_pre_scaled=False)
        assert torch.equal(ref[0], stored[base + "qweight"]), key
        assert torch.equal(ref[1], stored[base + "scales"]) and torch.equal(ref[2], stored[base + "scaled_zeros"])
    assert worst == pytest.approx(result.worst_rel_l2, rel=1e-3)
    assert 0 < worst < 0.15  # 4-bit min-max over 128 inputs: about 0.4 sigma a step, 0.12 sigma of error


def test_the_metadata_and_keys_are_what_the_qwen3_loader_reads(qwen3_folder, tmp_path):
    import transformers

    result = quantize_text_encoder(qwen3_folder, tmp_path / "q")
    path = tmp_path / "q" / result.file
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["text_encoder_usage"] == "qwen3_text_only" and meta["model_type"] == "qwen3_text"
    assert json.loads(meta["quantization_config"])["weight"]["group_size"] == 128
    config = json.loads(meta["config"])
    folder_config = json.loads((qwen3_folder / "config.json").read_text())
    theta = folder_config.get("rope_parameters", {}).get("rope_theta", folder_config.get("rope_theta"))
    assert config["rope_parameters"]["rope_theta"] == theta and config["hidden_size"] == 128
    # the loader builds a bare Qwen3Model from that config and refuses a missing or unexpected key
    model = transformers.Qwen3Model(transformers.Qwen3Config(**{k: v for k, v in config.items()
                                                                if k not in ("architectures",)}))
    modules = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    stored = load_file(str(path))
    packed = {k[: -len(".qweight")] for k in stored if k.endswith(".qweight")}
    assert packed == modules  # every linear 4-bit
    plain = {k for k in stored if not k.endswith((".qweight", ".scales", ".scaled_zeros"))}
    assert plain | {m + ".weight" for m in packed} == set(model.state_dict())


@pytest.mark.parametrize("which", ["qwen3", "t5"])
def test_written_then_read_back_as_bf16_by_flux_port(which, qwen3_folder, t5_folder, tmp_path):
    import transformers

    folder = qwen3_folder if which == "qwen3" else t5_folder
    result = quantize_text_encoder(folder, tmp_path / "q")
    back = convert_text_encoder(tmp_path / "q" / result.file, tmp_path / "bf16")
    assert back.ok
    cls = transformers.Qwen3Model if which == "qwen3" else transformers.T5EncoderModel
    model = cls.from_pretrained(tmp_path / "bf16")
    expected = af.oracle_state(load_file(str(tmp_path / "q" / result.file)))
    for key, want in expected.items():
        assert torch.equal(model.state_dict()[key], want.to(torch.bfloat16)), key


def test_a_file_that_is_4_bit_already_is_refused(tmp_path):
    from porting.errors import UsageError

    path = af.write_qwen3_file(tmp_path / "svdq-int4-Qwen3-text-Nunchaku.safetensors")
    with pytest.raises(UsageError) as err:
        quantize_text_encoder(path, tmp_path / "q")
    assert "4-bit already (14 layers)" in str(err.value)
    assert not (tmp_path / "q").exists()
