"""`--max-shard-size`: shards plus the standard index that diffusers' `from_pretrained` loads."""

from __future__ import annotations

import json
import re

import torch
from diffusers import Flux2Transformer2DModel

from .helpers import assert_same_tensors, leftovers, load_folder, run_port


def test_small_shards_with_standard_index_load_in_diffusers(tmp_path, capsys, tiny2_file):
    assert run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "single", "-q").code == 0
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "sharded", "--max-shard-size", "20KB", "-q")
    assert run.code == 0, run.err
    folder = tmp_path / "sharded"
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2
    assert all(re.fullmatch(rf"diffusion_pytorch_model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    tensors = load_folder(folder)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in shards:  # greedy packing: a shard only exceeds the limit when a single tensor does
        sizes = [tensors[k].numel() * tensors[k].element_size() for k, f in index["weight_map"].items() if f == shard]
        assert sum(sizes) <= 20_000 or len(sizes) == 1
    # same tensors as the single-file conversion, and diffusers loads the sharded folder strictly
    assert_same_tensors(tensors, load_folder(tmp_path / "single"))
    model, info = Flux2Transformer2DModel.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in tensors.items())
    assert leftovers(folder) == ["sharded"]


def test_sharded_diffusers_folder_converts_back_to_sharded_original(tmp_path, capsys, tiny2_file):
    assert run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "d", "--max-shard-size", "20KB", "-q").code == 0
    run = run_port(capsys, "convert", tmp_path / "d", "--to", "original", "--out", tmp_path / "o",
                   "--max-shard-size", "30KB", "-q")
    assert run.code == 0, run.err
    assert (tmp_path / "o" / "model.safetensors.index.json").is_file()
    from safetensors.torch import load_file

    assert_same_tensors(load_folder(tmp_path / "o"), load_file(str(tiny2_file)))
