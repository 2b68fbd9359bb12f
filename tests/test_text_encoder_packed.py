"""A 4-bit text encoder run packed (`AwqLinear`): the numbers of the bf16 folder `port convert` writes from the same
file, at a quarter of the quantized layers' bytes."""

from __future__ import annotations

import pytest
import torch

from porting.engine.text_encoder import convert_text_encoder
from porting.runtime.awq_text import AwqLinear, load_packed_text_encoder

from . import awqfiles as af


@pytest.mark.parametrize("which", ["qwen3", "t5"])
def test_packed_hidden_states_equal_the_bf16_folders(which, tmp_path):
    import transformers

    path = (af.write_qwen3_file if which == "qwen3" else af.write_t5_file)(tmp_path / "te.safetensors", seed=5)
    convert_text_encoder(path, tmp_path / "bf16")
    cls = transformers.Qwen3Model if which == "qwen3" else transformers.T5EncoderModel
    reference = cls.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    packed = load_packed_text_encoder(path)
    linears = [m for m in packed.modules() if isinstance(m, AwqLinear)]
    assert len(linears) == 14 and not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    packed_bytes = sum(m.packed.numel() for m in linears)
    assert packed_bytes * 4 == sum(m.in_features * m.out_features * 2 for m in linears)  # a quarter of bf16
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = packed(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # the same bf16 weights, the same matmuls


def test_a_bf16_text_encoder_is_not_run_packed(tmp_path):
    from porting.errors import InputError

    path = af.write_qwen3_file(tmp_path / "te.safetensors")
    convert_text_encoder(path, tmp_path / "bf16")
    with pytest.raises(InputError) as err:
        load_packed_text_encoder(tmp_path / "bf16")
    assert "not a 4-bit text encoder" in str(err.value)
