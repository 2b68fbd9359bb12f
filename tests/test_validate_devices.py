"""port validate --devices: the staged run as pipeline stages over several ranks (gloo on CPU here).

The report of a two-rank run must equal the single-process run's to the last digit (times, paths and the fields
that name the devices aside), a fault in a block owned by rank 1 must be located in that block, a failing rank must
surface as one error naming the rank and the stage (no hang), and a bad device list is refused with exit 2.

Ranks start as forks of one forkserver per test session, so only the first multi-rank run pays for importing torch
and diffusers.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint
from porting.engine.convert import convert
from validation.api import validate
from validation.distributed import RankFailed, parse_devices, split_stages

from .helpers import run_port

SMALL = dict(resolution=128, text_len=32, timesteps=(1.0, 0.5))  # 64 image + 32 text tokens, 2 timesteps
CLI_SMALL = ["--resolution", "128", "--text-len", "32", "--timesteps", "1.0,0.5"]
RANK1_BLOCK = "single_transformer_blocks.1"  # 2 ranks over 6 stages split by parameters: rank 1 owns it
# fields that name where the runs happened or when: everything else must be equal to the last digit
WHERE = ("created", "device", "reference", "environment", "distributed")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dev")
    out = folder / "transformer"
    convert(write_random_checkpoint(folder / "ft.safetensors", TINY_FLUX2, seed=3), out)
    return out


def perturb(key_to_break: str, scale: float, key: str, t: torch.Tensor) -> torch.Tensor:
    """A device-side weight fault (picklable as a partial, so that spawned ranks receive it)."""
    if key != key_to_break:
        return t
    g = torch.Generator().manual_seed(0)
    return t + scale * t.float().std() * torch.randn(t.shape, generator=g).to(t.dtype)


def numbers(report_json: Path) -> dict:
    d = json.loads(report_json.read_text())
    d["model"].pop("path")
    return {k: v for k, v in d.items() if k not in WHERE}


@pytest.mark.slow  # two torch.distributed processes; the staged split and its fault location are tested in one process
def test_two_cpu_ranks_equal_one_process_and_locate_a_fault_on_rank_1(converted, tmp_path):
    fault = functools.partial(perturb, f"{RANK1_BLOCK}.attn.to_out.weight", 0.1)
    one = validate(converted, device_weight_transform=fault, out=tmp_path / "one", **SMALL)
    two = validate(converted, devices="cpu,cpu", device_weight_transform=fault, out=tmp_path / "two", **SMALL)
    d = two.to_dict()
    ranks = d["distributed"]["ranks"]
    assert d["distributed"]["backend"] == "gloo" and [r["rank"] for r in ranks] == [0, 1]
    assert RANK1_BLOCK in ranks[1]["stages"] and RANK1_BLOCK not in ranks[0]["stages"]
    assert ranks[0]["stages"] + ranks[1]["stages"] == [b["stage"] for b in d["blocks"]]
    # the fault is located in rank 1's block, as in one process
    assert d["verdict"] == "fail" and d["blame"]["stage"] == RANK1_BLOCK and d["blame"]["original"] == "single_blocks.1"
    assert all(b["teacher_forced"]["ratio"] <= 2.0 for b in d["blocks"] if b["stage"] in ranks[0]["stages"])
    # the report rank 0 wrote is the single-process one, number for number
    assert numbers(tmp_path / "two" / "report.json") == numbers(tmp_path / "one" / "report.json")
    assert (tmp_path / "two" / "report.md").is_file()
    assert one.to_dict()["blocks"] == d["blocks"]


@pytest.mark.slow  # spawns two ranks again (the library-level equality test stays in the default run)
def test_cli_devices_cpu_cpu_writes_the_single_device_report(converted, tmp_path, capsys):
    single = run_port(capsys, "validate", converted, *CLI_SMALL, "--out", tmp_path / "one", "--quiet")
    assert single.code == 0, single.err
    multi = run_port(capsys, "validate", converted, *CLI_SMALL, "--devices", "cpu,cpu", "--out", tmp_path / "two",
                     "--json")
    assert multi.code == 0, multi.err
    doc = json.loads(multi.out)
    assert doc["verdict"] == "pass" and doc["device"] == "cpu,cpu" and doc["distributed"]["world_size"] == 2
    assert numbers(tmp_path / "two" / "report.json") == numbers(tmp_path / "one" / "report.json")
    assert "pipeline over 2 ranks (gloo)" in (tmp_path / "two" / "report.md").read_text()
    # the report is validate's own folder, with its ownership record, as a single-device run leaves it
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


def test_a_failing_rank_is_one_error_naming_the_rank_and_the_stage(converted, tmp_path, capsys):
    broken = tmp_path / "transformer"
    shutil.copytree(converted, broken)
    weights = broken / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    tensors[f"{RANK1_BLOCK}.attn.to_out.weight"][0, 0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    start = time.monotonic()
    run = run_port(capsys, "validate", broken, *CLI_SMALL, "--devices", "cpu,cpu", "--out", tmp_path / "r")
    assert run.code == 2, run.err  # the rank's own exit code: an unmeasurable golden is a usage error
    assert "rank 1" in run.msg and RANK1_BLOCK in run.msg and "NaN" in run.msg
    assert "Traceback" not in run.err and run.msg.count("Error:") == 1
    assert time.monotonic() - start < 120  # torn down, not waiting for a timeout
    assert not (tmp_path / "r").exists()


def hang_in(stage: str, model: torch.nn.Module) -> None:
    """A device-side hang in one block (picklable as a partial)."""
    model.get_submodule(stage).register_forward_pre_hook(lambda module, args: time.sleep(3600))


@pytest.mark.slow  # waits out a distributed timeout
def test_a_hung_rank_ends_in_a_timeout_error_not_a_hang(converted, tmp_path, monkeypatch):
    monkeypatch.setenv("FLUX_PORT_DIST_TIMEOUT", "8")
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        validate(converted, devices="cpu,cpu", prepare_device_model=functools.partial(hang_in, RANK1_BLOCK),
                 out=tmp_path / "r", **SMALL)
    assert time.monotonic() - start < 60
    assert "rank 0" in err.value.message and "rank 1" in err.value.message  # who waited, and for whom
    assert "Timed out" in err.value.message and "FLUX_PORT_DIST_TIMEOUT=8 s" in err.value.hint
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("devices,expected", [
    ("cpu", "two or more devices"),
    ("cuda:0,cuda:0", "same device"),
    ("npu,npu:0", "same device"),
    ("cuda:0,cpu", "mixes device types"),
    ("cpu,,cpu", "comma-separated"),
    ("cpu,gpu:1", "Unknown device"),
    ("mps,mps", "no torch.distributed backend"),
])
def test_bad_device_lists_are_refused_naming_the_option(converted, tmp_path, capsys, devices, expected):
    run = run_port(capsys, "validate", converted, "--devices", devices, "--out", tmp_path / "r")
    assert run.code == 2 and "--devices" in run.msg and expected in run.msg, run.err
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_unavailable_npus_are_refused_with_exit_2(converted, tmp_path, capsys):
    run = run_port(capsys, "validate", converted, "--devices", "npu:0,npu:1", "--out", tmp_path / "r")
    assert run.code == 2 and "--devices" in run.msg and 'pip install "flux-port[npu]"' in run.msg, run.err
    assert "Traceback" not in run.err and not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra,expected", [(["--runtime", "onnxruntime"], "--runtime"),
                                            (["--reference", "cuda"], "--reference"),
                                            (["--dtype", "fp32", "--golden-dtype", "fp32"], "one computation")])
def test_options_that_do_not_fit_a_pipeline_are_refused(converted, tmp_path, capsys, extra, expected):
    run = run_port(capsys, "validate", converted, "--devices", "cpu,cpu", *extra, "--out", tmp_path / "r")
    assert run.code == 2 and expected in run.msg, run.err


def test_devices_parse_to_specs():
    assert [str(s) for s in parse_devices("cuda:0, cuda:1")] == ["cuda:0", "cuda:1"]
    assert [str(s) for s in parse_devices(["cpu", "cpu", "cpu"])] == ["cpu", "cpu", "cpu"]


def test_stage_ranges_are_contiguous_non_empty_and_balanced():
    sizes = [5] + [40] * 8 + [20] * 24 + [3]  # embed, 8 double blocks, 24 single blocks, final (klein-9B's shape)
    for world in (2, 3, 4, 8):
        ranges = split_stages(sizes, world)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
        assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(world - 1))
        loads = [sum(sizes[a:b]) for a, b in ranges]
        assert max(loads) - min(loads) <= 2 * max(sizes)
    with pytest.raises(Exception, match="at most 3 devices"):
        split_stages([1, 1, 1], 4)


@pytest.mark.slow
def test_torchrun_two_processes_write_the_same_report(converted, tmp_path):
    """The torchrun path: two processes started by torchrun on this host, rank 0 writes the report."""
    one = validate(converted, out=tmp_path / "one", **SMALL)
    assert one.verdict == "pass"
    env = dict(os.environ)  # torchrun sets OMP_NUM_THREADS=1 per rank: the numbers must not depend on it
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                           "-m", "porting", "validate", str(converted), *CLI_SMALL, "--devices", "cpu,cpu", "--quiet",
                           "--out", str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert numbers(tmp_path / "two" / "report.json") == numbers(tmp_path / "one" / "report.json")
