"""Hostile inputs to the options added with SVDQuant convert / merge and publish --push: each case here was a defect
(an exit 70, a refusal naming the wrong option, a request sent before a name the hub refuses, a usage error reported
as a failed check); the refusals must name the option or file, exit 2 and leave nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.hubserver.harness import cli, client_env, hubs  # noqa: F401
from tests.hubserver.server import GOOD_TOKEN

from .helpers import leftovers, reference_model, run_port, save_state
from .reference.flux2_bfl import Flux2Params

# the narrowest FLUX.2 geometry SVDQuant's 128-wide tiles allow (as tests/test_svdquant_write.py)
TINY2 = Flux2Params(in_channels=16, context_dim=48, hidden=128, heads=2, depth=1, depth_single=1,
                    axes=(16, 16, 16, 16))


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save_state(tmp_path_factory.mktemp("hostile-src") / "klein-tiny.safetensors",
                      reference_model(TINY2, seed=4).state_dict(), torch.bfloat16)


def test_svdq_convert_prints_its_table(tmp_path, capsys, src):
    """A plain (not --json) run printed the plan, wrote the file, then exited 70 on the error table."""
    r = run_port(capsys, "convert", src, "--quantize", "svdq-int4", "--rank", "33", "--out", tmp_path / "q")
    assert r.code == 0, r.err
    assert "SVDQuant int4 rank 48" in r.out and "plain int4 g64" in r.out  # rank 33, stored padded to 48


def test_calibrate_is_checked_before_anything_runs(tmp_path, capsys, src):
    r = run_port(capsys, "convert", src, "--out", tmp_path / "bf16")
    assert r.code == 0, r.err
    folder = tmp_path / "bf16"
    (tmp_path / "empty").mkdir()
    pipe = tmp_path / "pipe"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    (pipe / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Flux2Transformer2DModel",
                                                                  "joint_attention_dim": 4096, "in_channels": 16}))
    cases = [(tmp_path / "missing", "no such folder"), (src, "not a folder"),
             (tmp_path / "empty", "no model_index.json"), (folder, "no model_index.json"),
             (pipe, "joint_attention_dim 4096")]
    for n, (base, why) in enumerate(cases):
        out = tmp_path / f"out{n}"
        r = run_port(capsys, "convert", folder, "--quantize", "svdq-int4", "--calibrate", base, "--out", out, "--json")
        assert r.code == 2, (base, r.out)
        error = json.loads(r.out)["error"]
        assert error.startswith(f"--calibrate {base}") and why in error, error
        assert leftovers(out) == []
    shutil.copy(folder / "config.json", pipe / "transformer" / "config.json")  # the same geometry: accepted as such
    r = run_port(capsys, "convert", folder, "--quantize", "svdq-int4", "--calibrate", pipe, "--out", pipe / "q")
    assert r.code == 2 and "--calibrate" in r.err and "inside" in r.err, r.err
    assert sorted(p.name for p in pipe.iterdir()) == ["model_index.json", "transformer"]


def test_weights_given_as_the_adapter(tmp_path, capsys, src):
    r = run_port(capsys, "convert", src, "--quantize", "svdq-int4", "--rank", "16", "--out", tmp_path / "q", "--json")
    assert r.code == 0, r.err
    svdq = tmp_path / "q" / json.loads(r.out)["file"]
    for base, adapter in ((svdq, svdq), (src, src), (src, svdq)):
        r = run_port(capsys, "merge", base, adapter, "--out", tmp_path / "m", "--json")
        assert r.code == 2, r.out
        assert json.loads(r.out)["error"].startswith(f"{adapter}: no key is an adapter factor"), r.out
        assert leftovers(tmp_path / "m") == []


@pytest.mark.parametrize("argv, why", [
    (["--push", "alice/" + "x" * 97], "longer than 96 characters"),
    (["--push", "x" * 97 + "/klein"], "longer than 96 characters"),
    (["--push", "alice/klein.git"], "ends in '.git'"),
    (["--push", "alice/a--b"], "holds '--'"),
    (["--push", "a/b/c"], "--push 'a/b/c' is not a repository id"),
    (["--push", "alice/klein", "--endpoint", ""], "--endpoint ''"),
    (["--push", "alice/klein", "--endpoint", "http://[::1"], "--endpoint 'http://[::1'"),
    (["--push", "alice/klein", "--timeout", "1e308"], "--timeout"),
])
def test_push_refused_before_any_request(cli, hubs, tmp_path, argv, why):  # noqa: F811
    argv = ["publish", "--base", str(tmp_path / "b"), "--transformer", str(tmp_path / "t"), "--report",
            str(tmp_path / "r.json"), "--out", str(tmp_path / "pub"), "--send-token", "--json", *argv]
    r = cli.run(argv, client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN), tmp_path)
    assert r.code == 2 and r.json["exit_code"] == 2, r
    assert why in r.json["error"], r.json
    assert hubs.log == [] and not (tmp_path / "pub").exists()


def test_batch_push_name_the_hub_refuses(hubs, tmp_path):  # noqa: F811
    """A job name makes `my-org/{job}` longer than the hub takes: refused before any step, not at the upload."""
    import subprocess
    import sys

    (tmp_path / "a.safetensors").write_bytes(b"x")
    name = "j" * 120
    (tmp_path / "jobs.toml").write_text(
        '[defaults]\nsteps = ["convert", "publish"]\npublish = { push = "alice/{job}" }\n\n'
        f'[[job]]\nname = "{name}"\nsource = "a.safetensors"\n')
    env = {**client_env(tmp_path, hubs), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "porting", "batch", "jobs.toml", "--out", "out", "--json"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    error = json.loads(r.stdout)["error"]
    assert name in error and "longer than 96 characters" in error, error
    assert not (tmp_path / "out").exists() and hubs.log == []


@pytest.mark.parametrize("key, value", [("transformer_blocks.0.attn.to_qkv.wscales", float("nan")),
                                        ("transformer_blocks.0.attn.to_qkv.smooth_factor", 0.0),
                                        ("single_transformer_blocks.0.attn.mlp_fc2.proj_down", float("nan"))])
def test_damaged_svdq_base_is_not_copied_into_a_merge(tmp_path, capsys, src, key, value):
    """Appending to the branch copies the base's layers without dequantizing them: a NaN scale, a zero smoothing
    factor (the kernel divides by it) or a NaN branch of a layer no adapter touches was written on, exit 0."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .lorakit import BY_NAME, make_parts, write_adapter

    r = run_port(capsys, "convert", src, "--quantize", "svdq-int4", "--rank", "16", "--out", tmp_path / "q", "--json")
    assert r.code == 0, r.err
    with safe_open(str(tmp_path / "q" / json.loads(r.out)["file"]), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = value
    base = tmp_path / "damaged.safetensors"
    save_file(tensors, str(base), meta)
    module = "transformer_blocks.0.attn.to_q"
    adapter = write_adapter(tmp_path / "l.safetensors", BY_NAME["peft-transformer"],
                            make_parts({module: (128, 128)}, [module], "lora", seed=1, rank=2))
    r = run_port(capsys, "merge", base, adapter, "--out", tmp_path / "m")
    assert r.code == 1 and key in r.err and "nothing was written" in r.err, r.err
    assert leftovers(tmp_path / "m") == []
