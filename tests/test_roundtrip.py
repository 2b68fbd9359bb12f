"""Round trips are bit-exact: original -> diffusers -> original (and back again), keys and bytes, in every dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from porting.engine.convert import convert

from .helpers import TINY1_DEV, TINY2, TINY2_GUIDANCE, assert_same_tensors, load_folder, reference_model, save_state

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", [TINY2, TINY2_GUIDANCE, TINY1_DEV], ids=["flux2-klein", "flux2-dev", "flux1-dev"])
def test_original_to_diffusers_to_original_is_bit_exact(tmp_path, params, dtype):
    state = {k: v.to(DTYPES[dtype]) for k, v in reference_model(params, seed=7).state_dict().items()}
    src = save_state(tmp_path / "original.safetensors", state)
    convert(src, tmp_path / "diffusers", to="diffusers", strict=True)
    convert(tmp_path / "diffusers", tmp_path / "back", to="original", strict=True)
    back = load_folder(tmp_path / "back")
    assert_same_tensors(back, load_file(str(src)))
    # and once more around: diffusers -> original -> diffusers gives the first diffusers folder again
    convert(tmp_path / "back", tmp_path / "diffusers2", to="diffusers", strict=True)
    assert_same_tensors(load_folder(tmp_path / "diffusers2"), load_folder(tmp_path / "diffusers"))


def test_prefixed_original_round_trips_to_unprefixed_original(tmp_path):
    """`model.diffusion_model.` is a storage prefix, not part of the names: it is dropped on the way."""
    state = reference_model(TINY2, seed=8).state_dict()
    src = save_state(tmp_path / "comfy.safetensors", state, torch.bfloat16, prefix="model.diffusion_model.")
    convert(src, tmp_path / "diffusers", strict=True)
    convert(tmp_path / "diffusers", tmp_path / "back", to="original", strict=True)
    assert_same_tensors(load_folder(tmp_path / "back"), {k: v.to(torch.bfloat16) for k, v in state.items()})


def test_dtype_cast_widening_round_trip_is_exact(tmp_path):
    """bf16 -> --dtype fp32 (diffusers) -> --dtype bf16 (original) returns the original bytes."""
    state = {k: v.to(torch.bfloat16) for k, v in reference_model(TINY2, seed=9).state_dict().items()}
    src = save_state(tmp_path / "bf16.safetensors", state)
    convert(src, tmp_path / "fp32", dtype="fp32", strict=True)
    assert {t.dtype for t in load_folder(tmp_path / "fp32").values()} == {torch.float32}
    convert(tmp_path / "fp32", tmp_path / "back", to="original", dtype="bf16", strict=True)
    assert_same_tensors(load_folder(tmp_path / "back"), state)
