"""Cross-check against diffusers' own single-file converters: bit-identical tensors on tiny checkpoints."""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.single_file_utils import (
    convert_flux2_transformer_checkpoint_to_diffusers,
    convert_flux_transformer_checkpoint_to_diffusers,
)
from safetensors.torch import load_file

from porting.engine.convert import convert

from .helpers import (
    TINY2,
    TINY2_GUIDANCE,
    Flux1Params,
    assert_same_tensors,
    load_folder,
    meta_shapes,
    reference_model,
    save_state,
)


def test_flux2_matches_diffusers_converter_bit_for_bit(tmp_path):
    for params, name in ((TINY2, "klein"), (TINY2_GUIDANCE, "dev")):
        src = save_state(tmp_path / f"{name}.safetensors", reference_model(params, seed=5).state_dict(),
                         torch.bfloat16)
        convert(src, tmp_path / name, strict=True)
        theirs = convert_flux2_transformer_checkpoint_to_diffusers(load_file(str(src)))
        assert_same_tensors(load_folder(tmp_path / name), theirs)


POOL_SIZE = 1_000_003  # prime, larger than any row count: rows of a tensor start at distinct pool offsets
POOL = torch.randint(-2**15, 2**15, (POOL_SIZE,), dtype=torch.int16, generator=torch.Generator().manual_seed(6))


def random_bits(shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """bf16 tensor of random bit patterns, cut from a tiled random pool (memcpy speed instead of an RNG call)."""
    n = torch.Size(shape).numel()
    tiled = POOL.repeat(-(-(n + offset) // POOL_SIZE))
    return tiled[offset:offset + n].view(torch.bfloat16).reshape(shape).clone()


@pytest.mark.slow  # writes two 1 GB files (D = 3072 is what diffusers' FLUX.1 converter hard-codes)
def test_flux1_matches_diffusers_converter_bit_for_bit(tmp_path):
    """diffusers' FLUX.1 converter hard-codes inner_dim 3072 and mlp_ratio 4 (its linear1 split sizes), so the
    checkpoint has D = 3072 with one double and one single block (~0.5 B parameters, bf16, random bit patterns)."""
    params = Flux1Params(in_channels=16, vec_in_dim=24, context_dim=32, hidden=3072, heads=24, depth=1,
                         depth_single=1, guidance=True)
    state = {k: random_bits(s, offset=i * 7919) for i, (k, s) in enumerate(meta_shapes(params).items())}
    src = save_state(tmp_path / "flux1-3072.safetensors", state)
    del state
    convert(src, tmp_path / "ours", strict=True)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(load_file(str(src)))
    assert len(theirs) == 16 + 32 + 14 + 4  # top-level + one double block + one single block + final layer
    assert_same_tensors(load_folder(tmp_path / "ours"), theirs)
