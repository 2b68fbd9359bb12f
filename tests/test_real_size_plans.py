"""Key plans at real size, from headers alone.

Each checkpoint is a sparse file: the real header (keys and shapes from the reference module tree on the meta
device, written by hand) followed by a hole of the right size, so an 18 or 64 GB file costs no disk. The plan and
`inspect` must come out of the header: the process reads only a few MB while they run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from porting.engine.convert import convert
from porting.skeleton import diffusers_skeleton

from .helpers import REAL1, REAL2, meta_shapes, run_port, write_header_only

# name -> (original tensors, diffusers tensors, parameters, bf16 bytes); flux2-checkpoints.md section 3 / 7
EXPECTED = {
    "klein-4B": (149, 169, 3_875_544_576),
    "klein-9B": (201, 233, 9_078_581_248),
    "FLUX.2-dev": (299, 331, 32_223_281_152),
    "FLUX.1-dev": (780, 1160, 11_901_408_320),
    "FLUX.1-schnell": (776, 1156, 11_891_178_560),
}
# published transformer/config.json values (section 2.2)
CONFIG = {
    "klein-4B": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                     guidance_embeds=False),
    "klein-9B": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                     guidance_embeds=False),
    "FLUX.2-dev": dict(num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
                       guidance_embeds=True),
}
FLUX2_COMMON = dict(attention_head_dim=128, in_channels=128, out_channels=None, patch_size=1, mlp_ratio=3.0,
                    axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, eps=1e-6, timestep_guidance_channels=256)


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far (/proc/self/io `rchar`)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.fixture(scope="module")
def real_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real")
    files = {name: write_header_only(folder / f"{name}.safetensors", meta_shapes(p))
             for name, p in {**REAL2, **REAL1}.items()}
    yield files
    for f in files.values():
        f.unlink()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_header_only_plan_has_the_published_counts(real_files, capsys, name):
    src = real_files[name]
    n_original, n_diffusers, params = EXPECTED[name]
    assert os.stat(src).st_size > params  # the logical size is real (bf16: 2 bytes per parameter) ...
    assert os.stat(src).st_blocks * 512 < 16 * 2**20  # ... and almost none of it is on disk
    convert(src, None, dry_run=True)  # warm-up: first use imports and builds the meta model class
    before = bytes_read()
    run = run_port(capsys, "convert", src, "--out", src.parent / f"{name}-out", "--dry-run", "--strict", "--json")
    read = bytes_read() - before
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert (doc["source_tensors"], doc["target_tensors"], doc["target_model_tensors"]) == (
        n_original, n_diffusers, n_diffusers)
    assert doc["parameters"] == params
    assert doc["output_bytes"] == 2 * params
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["variant"] == name
    assert read < 16 * 2**20, f"dry run read {read} bytes"
    assert not (src.parent / f"{name}-out").exists()


@pytest.mark.parametrize("name", list(CONFIG))
def test_inspect_json_names_variant_and_published_config(real_files, capsys, name):
    run = run_port(capsys, "inspect", real_files[name], "--json")
    assert run.code == 0, run.err
    info = json.loads(run.out)
    assert (info["family"], info["naming"], info["prefix"], info["variant"]) == ("flux2", "original", "", name)
    assert info["diffusers_class"] == "Flux2Transformer2DModel"
    assert info["tensors"] == EXPECTED[name][0] and info["parameters"] == EXPECTED[name][2]
    assert info["dtypes"] == {"BF16": EXPECTED[name][0]}
    assert info["config"] == {**FLUX2_COMMON, **CONFIG[name]}


@pytest.mark.parametrize("name", ["klein-9B", "FLUX.1-schnell"])
def test_header_only_plan_diffusers_to_original(tmp_path, name):
    """The reverse direction at real size, from a header written from the diffusers model's own meta state."""
    import diffusers

    n_original, n_diffusers, params = EXPECTED[name]
    if name.startswith("FLUX.1"):
        cls, config = diffusers.FluxTransformer2DModel, dict(guidance_embeds=False)
    else:
        cls, config = diffusers.Flux2Transformer2DModel, {k: v for k, v in CONFIG[name].items()}
    model = diffusers_skeleton(cls, config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    src = write_header_only(tmp_path / "diffusers-named.safetensors", shapes)
    result = convert(src, None, to="original", dry_run=True)
    summary = result.plan.summary()
    assert (summary["source_tensors"], summary["target_tensors"], summary["parameters"]) == (
        n_diffusers, n_original, params)
    assert summary["ok"] and summary["variant"] == name
