"""diffusers' own Nunchaku layout ("Nunchaku Lite"): folders built in it (tests/litefiles.py, deepcompressor's
packers, independent of flux-port) read back exactly, convert to bf16, run packed and in a pipeline; diffusers' own
`replace_with_nunchaku_linear` and `check_strict_state_dict_match` judge the layout."""

from __future__ import annotations

import json

import pytest
import torch

from .helpers import run_port

pytest.importorskip("deepcompressor.backend.nunchaku.convert",
                    reason="the oracle: pip install --no-deps deepcompressor-toolkit==0.1.0 (as .ci/run does)")

from .litefiles import check_with_diffusers, write_lite_folder  # noqa: E402

CASES = [("flux2", "int4"), ("flux2", "nvfp4"), ("flux1", "int4"), ("flux1", "nvfp4")]


@pytest.fixture(scope="module")
def lite(tmp_path_factory) -> dict[tuple[str, str], object]:
    root = tmp_path_factory.mktemp("lite")
    return {case: write_lite_folder(root, *case) for case in CASES}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.slow  # a child interpreter importing diffusers; test_svdq_layouts judges the same folders in its run
def test_diffusers_accepts_the_helper_folders(lite, tmp_path):
    """The helper's folders are the layout diffusers loads (the premise of every test below)."""
    verdicts = check_with_diffusers([fx.path for fx in lite.values()], tmp_path)
    for fx in lite.values():
        got = verdicts[str(fx.path)]
        assert got["errors"] == [], got["errors"][:3]
        assert got["replaced"] == sum(len(fx.config["quantization_config"][op]["targets"])
                                      for op in ("svdq_w4a4", "awq_w4a16"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_a_lite_folder_reads_back_exactly(lite, case):
    from porting.inputs import open_source

    fx = lite[case]
    source = open_source(fx.path, kind="weights")
    ckpt = source.view
    assert source.detection.table.name == fx.family
    assert set(ckpt.tensors) == set(fx.expected)
    for key, want in fx.expected.items():
        got = ckpt.read(key)
        assert got.shape == want.shape, key
        assert _rel(got, want) < 1e-6, (key, _rel(got, want))
    details = ckpt.quantization.details
    assert details["layout"] == "diffusers" and details["precision"] == fx.precision and details["rank"] == fx.rank


def test_inspect_names_the_layout_and_convert_writes_bf16(lite, tmp_path, capsys):
    fx = lite[("flux2", "int4")]
    run = run_port(capsys, "inspect", fx.path, "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["quantization"]["format"].startswith("Nunchaku Lite (diffusers) int4")
    out = tmp_path / "bf16"
    run = run_port(capsys, "convert", fx.path, "--out", out)
    assert run.code == 0, run.err
    from safetensors.torch import load_file

    written = load_file(out / "diffusion_pytorch_model.safetensors")
    assert set(written) == set(fx.expected)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    for key, want in fx.expected.items():
        assert _rel(written[key], want) < 4e-3, key


@pytest.mark.parametrize("case", [("flux2", "nvfp4"), ("flux1", "int4")], ids=lambda c: "-".join(c))
def test_a_lite_folder_runs_packed(lite, case):
    from porting.runtime.svdq_linear import SvdqLinear
    from porting.runtime.svdq_model import load_svdq_transformer

    from .test_svdq_runtime import _inputs, _model

    fx = lite[case]
    config = {k: v for k, v in fx.config.items() if k != "quantization_config"}
    oracle = _model(config, fx.expected)
    packed = load_svdq_transformer(fx.path, torch.float32, "w4a16")
    assert len([m for m in packed.modules() if isinstance(m, SvdqLinear)]) == len(fx.config["quantization_config"][
        "svdq_w4a4"]["targets"]) + len(fx.config["quantization_config"]["awq_w4a16"]["targets"])
    inputs = _inputs(config, fx.family)
    with torch.no_grad():
        assert _rel(packed(**inputs, return_dict=False)[0], oracle(**inputs, return_dict=False)[0]) < 1e-5


def test_generate_with_a_lite_transformer(lite, tmp_path, capsys):
    from porting.demo.bases import write_tiny_base

    base = write_tiny_base(tmp_path / "base", "klein")
    image = tmp_path / "out.png"
    run = run_port(capsys, "generate", base, "--transformer", lite[("flux2", "int4")].path, "--prompt", "a fox",
                   "--steps", "1", "--size", "32", "--output", image, "--quiet")
    assert run.code == 0, run.err
    assert image.is_file()


def test_a_target_missing_a_part_is_refused_by_name(lite, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    fx = lite[("flux2", "int4")]
    bad = tmp_path / "bad"
    shutil.copytree(fx.path, bad)
    state = load_file(bad / "diffusion_pytorch_model.safetensors")
    del state["transformer_blocks.0.attn.to_k.proj_up"]
    save_file(state, bad / "diffusion_pytorch_model.safetensors")
    run = run_port(capsys, "inspect", bad)
    assert run.code == 2
    assert "transformer_blocks.0.attn.to_k.proj_up" in run.err
