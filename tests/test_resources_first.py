"""Issue 29, rule 2: every resource a request implies is checked before any work. One test per size-bearing
option and config field, each run under a small address-space limit (the soft RLIMIT_AS of this process, put back
afterwards), so that an allocation the estimate should have prevented fails the test at once instead of passing
late (or eating the machine). Each refusal is exit 2 with the estimate, and nothing is written."""

from __future__ import annotations

import importlib.util
import json
import resource
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from porting.pipeline.publish import publish

from .helpers import run_port

HEADROOM = 1 << 30  # what a refused run may still allocate: far less than any of the requests below


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextmanager
def small_address_space() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def refused(capsys, *argv: str | Path) -> dict:
    with small_address_space():
        run = run_port(capsys, *argv, "--json")
    assert run.code == 2, (run.code, run.out[-2000:], run.err[-2000:])
    return json.loads(run.out)


@pytest.fixture(scope="module")
def published(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("res-pub") / "klein"
    publish(port["base"], port["transformer"], out, report=port["pass"], link="copy")
    return out


def _with_config(published: Path, tmp_path: Path, component: str, **fields: object) -> Path:
    copy = tmp_path / "hostile"
    shutil.copytree(published, copy)
    path = copy / component / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return copy


# --- port validate ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value, shown", [
    ("--resolution", "1000000", "--resolution 1000000"),
    ("--text-len", "100000000", "--text-len 100000000"),
    ("--seeds", ",".join(map(str, range(20000))), "60000 case(s)"),  # the batch: seeds x timesteps
    ("--timesteps", ",".join(["0.5"] * 20000), "20000 case(s)"),
])
def test_validate_sizes_are_estimated_first(capsys, port, tmp_path, option, value, shown):
    doc = refused(capsys, "validate", port["transformer"], option, value, "--out", tmp_path / "r")
    assert shown in doc["error"] and "GiB" in doc["error"] and "nothing was done" in doc["error"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("reference", ["cuda", "npu"])
def test_validate_with_an_accelerator_reference_is_estimated_on_the_host_before_the_device_is_probed(
        capsys, port, tmp_path, reference):
    """The host's share (weights staged, the cpu device under test, float64 compares) is refused first, from the
    options and the headers, before any backend is imported; a request that fits is then refused for the missing
    device (docs/validate.md, "Memory": the order)."""
    doc = refused(capsys, "validate", port["transformer"], "--reference", reference, "--resolution", "1000000",
                  "--out", tmp_path / "r")
    assert f"validating with the golden on {reference} at --resolution 1000000" in doc["error"]
    assert "the host needs about" in doc["error"] and "nothing was done" in doc["error"]
    assert "The largest part is" in doc["hint"] and "--resolution" in doc["hint"]
    if reference == "cuda" and not torch.cuda.is_available():
        doc = refused(capsys, "validate", port["transformer"], "--reference", reference, "--out", tmp_path / "r")
        assert "--reference cuda: no CUDA device available" in doc["error"] and "--reference cpu" in doc["hint"]
    if reference == "npu" and importlib.util.find_spec("torch_npu") is None:
        doc = refused(capsys, "validate", port["transformer"], "--reference", reference, "--out", tmp_path / "r")
        assert "--reference npu needs torch_npu, which is not installed" in doc["error"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("devices", ["cuda:0,cuda:1", "npu:0,npu:1"])
def test_validate_accelerator_ranks_are_estimated_on_the_host_before_the_devices_are_probed(capsys, port, tmp_path,
                                                                                          devices):
    """Each accelerator rank stages its weights and compares its stages through this host: two of them at
    --text-len 2,000,000 are refused for the host first, on a machine that has neither device."""
    doc = refused(capsys, "validate", port["transformer"], "--devices", devices, "--text-len", "2000000",
                  "--out", tmp_path / "r")
    assert "--devices: 2 processes on this host" in doc["error"] and "float64 copies compared" in doc["error"]
    assert not (tmp_path / "r").exists()


def test_validate_devices_beyond_the_stages_are_refused_before_any_rank(capsys, port, tmp_path):
    doc = refused(capsys, "validate", port["transformer"], "--devices", ",".join(["cpu"] * 20000),
                  "--out", tmp_path / "r")
    assert "20,000 devices for a model of 6 stages" in doc["error"] and "no rank was started" in doc["error"]
    doc = refused(capsys, "validate", port["transformer"], "--devices", ",".join(["cpu"] * 7), "--out", tmp_path / "r")
    assert "7 devices for a model of 6 stages" in doc["error"]
    assert not (tmp_path / "r").exists()


def test_validate_devices_ranks_that_do_not_fit_together_are_refused(capsys, port, tmp_path):
    # six ranks each as large as one run at --text-len 2,000,000: one would fit a large machine, six not this one
    doc = refused(capsys, "validate", port["transformer"], "--devices", ",".join(["cpu"] * 6), "--text-len",
                  "2000000", "--out", tmp_path / "r")
    assert "6 ranks x (" in doc["error"]


def test_devices_with_device_is_a_usage_error(capsys, port, tmp_path):
    doc = refused(capsys, "validate", port["transformer"], "--devices", "cpu,cpu", "--device", "cpu",
                  "--out", tmp_path / "r")
    assert "--devices cpu,cpu with --device cpu" in doc["error"]
    assert not (tmp_path / "r").exists()


# --- port generate / compare / bench ---------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", ["generate", "compare", "bench"])
def test_pipeline_size_is_estimated_first(capsys, published, tmp_path, verb):
    args = {"generate": [published, "--prompt", "x", "--output", tmp_path / "x.png"],
            "compare": [published, published, "--prompt", "x", "--out", tmp_path / "c"],
            "bench": [published, "--out", tmp_path / "b"]}[verb]
    doc = refused(capsys, verb, *args, "--size", "1000000", "--steps", "1")
    assert "1000000x1000000" in doc["error"] and "GiB" in doc["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("component, field, value", [
    ("transformer", "num_layers", 10**12), ("transformer", "num_single_layers", 10**12),
    ("transformer", "num_attention_heads", 10**12), ("transformer", "attention_head_dim", 10**12),
    ("text_encoder", "num_hidden_layers", 10**12), ("text_encoder", "hidden_size", 10**12),
    ("text_encoder", "intermediate_size", 10**15), ("text_encoder", "vocab_size", 10**15),
    ("vae", "layers_per_block", 10**12), ("vae", "block_out_channels", [8, 10**9]),
])
def test_a_config_asking_for_a_huge_model_is_refused_before_it_is_built(capsys, published, tmp_path, component,
                                                                       field, value):
    hostile = _with_config(published, tmp_path, component, **{field: value})
    doc = refused(capsys, "generate", hostile, "--prompt", "x", "--size", "32", "--steps", "1",
                  "--output", tmp_path / "x.png")
    assert f"{component}/config.json" in doc["error"] and "building the model its config describes" in doc["error"]
    assert not (tmp_path / "x.png").exists()


# --- port export -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [("--size", "1000000"), ("--text-len", "100000000")])
def test_ryzenai_static_shapes_are_estimated_first(capsys, published, tmp_path, option, value):
    pytest.importorskip("onnxscript", reason="the [onnx] extra builds the ryzenai export")
    doc = refused(capsys, "export", published, "--target", "ryzenai", option, value, "--out", tmp_path / "e")
    assert f"{option} {value}" in doc["error"] and "GiB" in doc["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_refuses_a_huge_config_before_building_it(capsys, published, tmp_path):
    pytest.importorskip("onnxscript", reason="the [onnx] extra builds the export")
    hostile = _with_config(published, tmp_path, "transformer", num_layers=10**12)
    doc = refused(capsys, "export", hostile, "--components", "transformer", "--out", tmp_path / "e")
    assert "num_layers 1000000000000" in doc["error"]
    assert not (tmp_path / "e").exists()


def test_compare_prompt_count_is_estimated_first(capsys, published, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\n" * 200000)  # each prompt's embedding, images and grid row are held at once
    out = tmp_path / "c"
    doc = refused(capsys, "compare", published, published, "--prompts", prompts, "--size", "1024", "--steps", "1",
                  "--out", out)
    assert "comparing 200,000 prompt(s) at 1024x1024" in doc["error"]
    assert not out.exists()
