"""Model families: the generated diffusers shape data agrees with diffusers itself, and a family registered from
outside the package converts through the unchanged engine."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.engine.convert import convert
from porting.errors import UnknownArchitectureError
from porting.families import families, get_family, register, unregister
from porting.families.generate_shapes import generate
from porting.families.meta import meta_state_shapes
from porting.inputs.detect import detect
from porting.tensors.checkpoint import open_checkpoint

from .toyfamily.toy import make as make_toy


def _configs(name: str) -> list[dict]:
    family = get_family(name)
    base = [dict(family.tiny_config), *map(dict, family.real_configs.values()), *map(dict, family.shape_probes)]
    variations = [{**base[0], "guidance_embeds": not base[0].get("guidance_embeds", False)},
                  {**base[0], "out_channels": base[0]["in_channels"] + 4, "num_layers": 3, "num_single_layers": 1}]
    return base + variations


@pytest.mark.parametrize("name", ["flux1", "flux2"])
def test_shape_data_equals_the_diffusers_meta_model(name: str) -> None:
    family = get_family(name)
    for config in _configs(name):
        assert family.diffusers_shapes(config) == meta_state_shapes(family.diffusers_class, config), config


@pytest.mark.parametrize("name", ["flux1", "flux2"])
def test_shipped_shape_data_is_what_the_generator_writes_today(name: str) -> None:
    """A diffusers upgrade that changes the model fails here, with the command to regenerate the data."""
    family = get_family(name)
    shipped = family.resource_path(family.shapes_resource).read_text()
    assert generate(family) == shipped, f"run: python -m porting.families shapes {name}"


def test_families_are_listed_in_name_order() -> None:
    assert [f.name for f in families()] == sorted(f.name for f in families())


@pytest.fixture
def toy():
    family = register(make_toy())
    yield family
    unregister(family.name)


def _toy_checkpoint(path: Path, width: int = 4, layers: int = 2, in_features: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(width, in_features, generator=g),
             "head.weight": torch.randn(2 * width, width, generator=g)}
    for n in range(layers):
        state[f"blocks.{n}.qkv.weight"] = torch.randn(3 * width, width, generator=g)
        state[f"blocks.{n}.out.weight"] = torch.randn(width, width, generator=g)
    save_file(state, str(path))
    return state


def test_a_toy_family_from_a_test_folder_converts_without_touching_the_engine(toy, tmp_path: Path) -> None:
    src = tmp_path / "toy.safetensors"
    state = _toy_checkpoint(src)
    result = convert(src, tmp_path / "out", strict=True)
    assert result.plan.ok and result.plan.detection.table.name == "toy"
    out = load_file(str(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))
    q, k, v = state["blocks.1.qkv.weight"].chunk(3)
    assert torch.equal(out["layers.1.to_q.weight"], q) and torch.equal(out["layers.1.to_v.weight"], v)
    top, bottom = state["head.weight"].chunk(2)
    assert torch.equal(out["proj_out.weight"], torch.cat([bottom, top]))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["_class_name"] == "ToyTransformer" and config["width"] == 4 and config["num_layers"] == 2
    back = convert(tmp_path / "out", tmp_path / "back", to="original", strict=True)
    assert back.plan.ok
    again = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)


def test_the_toy_familys_strict_plan_checks_shapes_from_its_own_data(toy, tmp_path: Path) -> None:
    src = tmp_path / "toy.safetensors"
    state = _toy_checkpoint(src)
    state["blocks.0.out.weight"] = torch.zeros(4, 5)
    save_file(state, str(src))
    result = convert(src, None, strict=False, dry_run=True)
    assert [m[0] for m in result.plan.mismatched] == ["layers.0.to_out.weight"]


def _header_only(path: Path, keys: list[str]) -> Path:
    header = {k: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, k in enumerate(keys)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4 * len(keys))
    return path


def test_a_checkpoint_two_tables_claim_is_refused_with_both_names(toy, tmp_path: Path) -> None:
    flux2 = get_family("flux2").table.detect["original"]
    both = _header_only(tmp_path / "both.safetensors", [*flux2, *toy.table.detect["original"]])
    with pytest.raises(UnknownArchitectureError, match=r"more than one mapping table claims.*flux2.*toy"):
        detect(open_checkpoint(both))


def test_a_table_without_its_format_version_is_refused(tmp_path: Path) -> None:
    from porting.errors import MappingTableError
    from porting.families.mapping import load_table_file

    text = get_family("flux2").resource_path("flux2.toml").read_text().replace("format_version = 1\n", "")
    path = tmp_path / "old.toml"
    path.write_text(text)
    with pytest.raises(MappingTableError, match="format_version None"):
        load_table_file(path)


def test_validate_refuses_a_family_without_stages(toy, capsys, tmp_path: Path) -> None:
    from .helpers import run_port

    src = tmp_path / "toy.safetensors"
    _toy_checkpoint(src)
    assert not toy.has_stages and get_family("flux1").has_stages and get_family("flux2").has_stages
    run = run_port(capsys, "validate", src, "--out", tmp_path / "r", "--resolution", "32", "--text-len", "8")
    assert run.code == 2 and "no staged runner for Toy" in run.msg and "declares no stages" in run.msg
    assert "convert-only" in run.msg and "Traceback" not in run.err
    assert not (tmp_path / "r").exists()
