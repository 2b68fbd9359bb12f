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
# the estimates count this limit (RLIMIT_AS) too: a request meant to pass them (to meet a later check) gets more room
ROOM_TO_PASS = 8 << 30


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextmanager
def small_address_space(headroom: int = HEADROOM) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def refused(capsys, *argv: str | Path, headroom: int = HEADROOM) -> dict:
    with small_address_space(headroom):
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
        doc = refused(capsys, "validate", port["transformer"], "--reference", reference, "--out", tmp_path / "r",
                      headroom=ROOM_TO_PASS)
        assert "--reference cuda: no CUDA device available" in doc["error"] and "--reference cpu" in doc["hint"]
    if reference == "npu" and importlib.util.find_spec("torch_npu") is None:
        doc = refused(capsys, "validate", port["transformer"], "--reference", reference, "--out", tmp_path / "r",
                      headroom=ROOM_TO_PASS)
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
                  "--out", out, headroom=ROOM_TO_PASS)  # each side's 1024x1024 on cpu fits; the prompts do not
    assert "comparing 200,000 prompt(s) at 1024x1024" in doc["error"]
    assert not out.exists()


# --- the limits of this process, not only the host's memory -------------------------------------------------------

def test_validate_counts_the_address_space_limit_in_its_estimate(capsys, port, tmp_path):
    """--text-len 2,000,000 fits the host's free memory but not this process's RLIMIT_AS: the estimate refuses it
    before any tensor is made (it used to pass and end in exit 70 from torch's allocator)."""
    doc = refused(capsys, "validate", port["transformer"], "--text-len", "2000000", "--out", tmp_path / "r")
    assert "--text-len 2000000" in doc["error"] and "under the address-space limit (RLIMIT_AS)" in doc["error"]
    assert "nothing was done" in doc["error"]
    assert not (tmp_path / "r").exists()


def test_an_allocation_that_fails_past_the_estimate_is_exit_2_with_the_estimate(capsys, monkeypatch, port, tmp_path):
    """Injected fault: the estimate counts no copy of the residual stream instead of 24, so it passes and torch's
    allocator fails under the address-space limit; the run is still exit 2 naming the estimate, not a flux-port bug."""
    import porting.resources

    monkeypatch.setattr(porting.resources, "ACTIVATION_COPIES", 0)
    doc = refused(capsys, "validate", port["transformer"], "--text-len", "2000000", "--out", tmp_path / "r")
    assert "the run ran out of memory (RuntimeError: " in doc["error"], doc["error"]
    assert "flux-port's estimate was that validating at --resolution 256 --text-len 2000000" in doc["error"]
    assert "GiB" in doc["error"] and "lower the sizes" in doc["hint"]
    assert not (tmp_path / "r").exists()


def test_a_child_under_a_4_gib_address_space_limit_is_refused_with_the_estimate(port, tmp_path):
    """The case as a user meets it: `ulimit -v 4194304` (a child process under setrlimit), then validate."""
    import os
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    run = subprocess.run([sys.executable, "-m", "porting", "validate", str(port["transformer"]), "--text-len",
                          "2000000", "--out", str(tmp_path / "r"), "--json"], capture_output=True, text=True,
                         preexec_fn=limit, timeout=300, cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "FLUX_PORT_DEBUG": ""})
    assert run.returncode == 2, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    error = json.loads(run.stdout)["error"]
    assert "needs about" in error and "4.00 GiB under the address-space limit (RLIMIT_AS)" in error, error
    assert not (tmp_path / "r").exists()


def _cgroup_tree(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_v2_limits_of_the_process_and_its_ancestors_are_read(tmp_path):
    from porting.resources import cgroup_limits

    root = _cgroup_tree(tmp_path, "0::/user.slice/job\n", {
        "sys/fs/cgroup/user.slice/memory.max": str(8 * 2**30),
        "sys/fs/cgroup/user.slice/memory.current": str(3 * 2**30),
        "sys/fs/cgroup/user.slice/job/memory.max": "max\n",  # no limit of its own
        "sys/fs/cgroup/user.slice/job/memory.current": str(2**30),
        "sys/fs/cgroup/user.slice/memory.stat": f"anon 100\ninactive_file {2**30}\nactive_file 5\n",
    })
    limits = cgroup_limits(root)
    assert [(lim.available, lim.total) for lim in limits] == [(6 * 2**30, 8 * 2**30)]  # 8 - (3 - 1 reclaimable)
    assert limits[0].name == "the cgroup limit (memory.max of /user.slice)"


def test_cgroup_v1_limit_is_read_and_its_no_limit_value_ignored(tmp_path):
    from porting.resources import cgroup_limits

    root = _cgroup_tree(tmp_path, "4:memory:/docker/abc\n3:cpu:/\n0::/\n", {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(10 * 2**30),
        "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(4 * 2**30),
        "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": str(2**30),
        "sys/fs/cgroup/memory/docker/abc/memory.stat": "cache 7\ntotal_inactive_file 0\n",
    })
    limits = cgroup_limits(root)
    assert [(lim.available, lim.total, lim.name) for lim in limits] == [
        (3 * 2**30, 4 * 2**30, "the cgroup limit (memory.limit_in_bytes of /docker/abc)")]


def test_the_tightest_limit_binds_and_is_named_in_the_refusal(tmp_path, monkeypatch):
    """A cgroup limit below the host's free memory is what the estimate compares with, and the refusal names it."""
    import porting.resources as resources

    root = _cgroup_tree(tmp_path, "0::/\n", {"sys/fs/cgroup/memory.max": str(2**20),
                                             "sys/fs/cgroup/memory.current": "0"})
    tightest = resources.memory_limit(root)
    assert (tightest.available, tightest.name) == (2**20, "the cgroup limit (memory.max of /)")
    assert resources.memory_limit(tmp_path / "no-such-root").available > 2**20  # no cgroup there: the host's
    monkeypatch.setattr(resources, "memory_limit", lambda root=Path("/"): tightest)
    with pytest.raises(resources.ResourceError, match=r"0\.00 GiB is available of 0\.00 GiB under the cgroup limit "
                                                      r"\(memory.max of /\); nothing was done"):
        resources.require_memory("a run", 2**30, "weights 1 GiB", hint="smaller")


def test_no_cgroup_file_is_no_limit(tmp_path):
    from porting.resources import cgroup_limits

    assert cgroup_limits(tmp_path) == []
    root = _cgroup_tree(tmp_path / "x", "0::/a\n", {"sys/fs/cgroup/a/memory.max": "max"})
    assert cgroup_limits(root) == []
