"""`port batch`: a jobs file run on a local Ray cluster and on the local executor, resumed, and resumed after the
driver was killed. Tiny models built on the fly; no network."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from porting.cli.batch.steps import TEST_CRASH_ENV, TRACE_ENV
from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint
from porting.demo.tinypipe import build_demo_base

from .helpers import run_port

ROOT = Path(__file__).resolve().parents[1]
VALIDATE = 'validate = { resolution = 64, text-len = 32, timesteps = "0.5", intrinsic = "emulated" }'


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A base, two good checkpoints, one truncated, and a jobs file: a validated job, a job published with
    --skip-validation, a job whose source is truncated."""
    root = tmp_path_factory.mktemp("batch")
    build_demo_base(root / "base")
    write_random_checkpoint(root / "a.safetensors", TINY_FLUX2, seed=5)
    write_random_checkpoint(root / "b.safetensors", TINY_FLUX2, seed=6)
    data = (root / "b.safetensors").read_bytes()
    (root / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    (root / "jobs.toml").write_text(f"""
[defaults]
base = "base"
steps = ["convert", "validate", "publish"]
{VALIDATE}

[[job]]
name = "a"
source = "a.safetensors"

[[job]]
name = "b"
source = "b.safetensors"
steps = ["convert", "publish"]
publish = {{ skip-validation = true }}

[[job]]
name = "trunc"
source = "trunc.safetensors"
""")
    return root


def _trace(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _summary(out: Path) -> dict:
    return json.loads((out / "_batch" / "batch.json").read_text())


def _normal(doc: dict) -> dict:
    """The summary without what differs between runs that did the same work: times, executor, folders."""
    out = doc["out"]
    text = json.dumps({k: v for k, v in doc.items() if k not in ("seconds", "executor", "out", "steps_run_now")})
    doc = json.loads(text.replace(out, "DIR"))
    for job in doc["jobs"]:
        for step in job["steps"]:
            step.pop("seconds", None)
            step.pop("ran_now", None)
            step.pop("dispatch_s", None)
            if step.get("step") == "convert" and step.get("produced"):
                # convert leaves the weights identity to validate: what it produced is the fingerprint of the folder
                # it wrote (sizes and times), which two runs of the same work do not share
                step["produced"] = "FOLDER"
            if step.get("step") == "validate" and step.get("produced"):
                # the last part is the report's digest: a report carries its run's time, so it differs run to run
                step["produced"] = step["produced"].rsplit(":", 1)[0]
    return doc


@pytest.fixture(scope="module")
def ray_cluster(work):
    ray = pytest.importorskip("ray")
    os.environ[TRACE_ENV] = str(work / "trace.txt")
    os.environ[TEST_CRASH_ENV] = f"b:convert:{work / 'crashed-once'}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2**20,
             _memory=6 * 2**30, logging_level="ERROR")
    yield ray
    ray.shutdown()
    os.environ.pop(TEST_CRASH_ENV, None)
    os.environ.pop(TRACE_ENV, None)


@pytest.mark.slow  # starts a local Ray cluster and worker processes
def test_ray_batch_passes_fails_retries_and_resumes(work, ray_cluster, capsys):
    out, trace = work / "out-ray", work / "trace.txt"
    run = run_port(capsys, "batch", work / "jobs.toml", "--out", out, "--executor", "ray", "--json")
    assert run.code == 1, run.err  # one job failed
    doc = json.loads(run.out)
    assert doc == _summary(out) | {"exit_code": 1}
    jobs = {j["name"]: j for j in doc["jobs"]}
    assert jobs["a"]["state"] == "done" and jobs["a"]["validate_verdict"] == "pass"
    assert jobs["b"]["state"] == "done" and jobs["b"]["published"] == str(out / "b" / "published")
    bad = jobs["trunc"]["steps"]
    assert bad[0]["state"] == "failed" and bad[0]["exit_code"] == 2 and "truncated" in bad[0]["error"]
    assert [s["state"] for s in bad[1:]] == ["skipped", "skipped"]
    # the worker running b's convert died once (os._exit); Ray ran the task again
    assert (work / "crashed-once").exists() and _trace(trace).count("b convert") == 2
    assert (out / "b" / "journal" / "convert" / "step.json").is_file()

    from diffusers import Flux2KleinPipeline

    for name in ("a", "b"):
        pipe = Flux2KleinPipeline.from_pretrained(jobs[name]["published"])
        assert type(pipe).__name__ == "Flux2KleinPipeline"

    before = len(_trace(trace))
    again = run_port(capsys, "batch", work / "jobs.toml", "--out", out, "--executor", "ray", "--json")
    assert again.code == 1
    assert _trace(trace)[before:] == ["trunc convert"]  # nothing finished redone; the failure retried
    doc2 = json.loads(again.out)
    assert doc2["steps_run_now"] == 1 and _normal(doc2) == _normal(doc)
    (work / "ray-summary.json").write_text(json.dumps(doc))


@pytest.mark.slow  # starts a local Ray cluster and worker processes
def test_local_executor_writes_the_same_summary(work, ray_cluster, capsys):
    if not (work / "ray-summary.json").exists():
        pytest.skip("needs the summary of test_ray_batch_passes_fails_retries_and_resumes")
    ray_doc = json.loads((work / "ray-summary.json").read_text())
    out = work / "out-local"
    run = run_port(capsys, "batch", work / "jobs.toml", "--out", out, "--json")
    assert run.code == 1, run.err
    doc = json.loads(run.out)
    assert doc["executor"] == "local" and _normal(doc) == _normal(ray_doc)


@pytest.mark.slow  # starts a local Ray cluster and worker processes
def test_a_changed_source_is_redone_from_the_first_affected_step(work, ray_cluster, capsys):
    out, trace = work / "out-local", work / "trace.txt"
    write_random_checkpoint(work / "b.safetensors", TINY_FLUX2, seed=7)
    before = len(_trace(trace))
    run = run_port(capsys, "batch", work / "jobs.toml", "--out", out, "--json")
    assert run.code == 1
    assert sorted(_trace(trace)[before:]) == ["b convert", "b publish", "trunc convert"]


def test_refusals(work, capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[job]]\nname = "x"\nsource = "a.safetensors"\nconvert = { out = "/tmp/x" }\n')
    run = run_port(capsys, "batch", bad, "--out", tmp_path / "o")
    assert run.code == 2 and "convert.out" in run.msg
    bad.write_text('[[job]]\nname = "x"\nsource = "a.safetensors"\nsteps = ["publish", "convert"]\n')
    assert run_port(capsys, "batch", bad, "--out", tmp_path / "o").code == 2
    bad.write_text('[[job]]\nname = "x"\nsource = "a.safetensors"\nvalidate = { max-ratio = nan }\n')
    run = run_port(capsys, "batch", bad, "--out", tmp_path / "o")
    assert run.code == 2 and "max-ratio" in run.msg
    run = run_port(capsys, "batch", work / "jobs.toml", "--out", work)  # the output would contain the inputs
    assert run.code == 2 and "contains" in run.msg


def test_without_ray_the_ray_executor_names_the_extra(work, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    run = run_port(capsys, "batch", work / "jobs.toml", "--out", work / "o", "--executor", "ray")
    assert run.code == 2 and "flux-port[ray]" in run.msg


@pytest.mark.slow
def test_killing_the_driver_then_rerunning_runs_no_finished_step_twice(tmp_path):
    build_demo_base(tmp_path / "base")
    for i in range(3):
        write_random_checkpoint(tmp_path / f"s{i}.safetensors", TINY_FLUX2, seed=10 + i)
    jobs = "\n".join(f'[[job]]\nname = "j{i}"\nsource = "s{i}.safetensors"\n' for i in range(3))
    (tmp_path / "jobs.toml").write_text(f'[defaults]\nbase = "base"\nsteps = ["convert", "validate", "publish"]\n'
                                        f'{VALIDATE}\n{jobs}')
    out, trace = tmp_path / "out", tmp_path / "trace.txt"
    env = {**os.environ, TRACE_ENV: str(trace), "PYTHONPATH": str(ROOT)}
    env.pop(TEST_CRASH_ENV, None)
    cmd = [sys.executable, "-m", "porting", "batch", str(tmp_path / "jobs.toml"), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not list(out.glob("*/journal/validate/step.json")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its pool, mid-batch
    proc.wait()
    finished = {(p.parts[-4], p.parts[-2]) for p in out.glob("*/journal/*/step.json")
                if json.loads(p.read_text())["state"] == "done"}
    assert finished and len(finished) < 9
    rerun = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    runs = [tuple(line.split()) for line in _trace(trace)]
    for job_step in finished:
        assert runs.count(job_step) == 1, job_step
    assert sorted(set(runs)) == sorted((f"j{i}", s) for i in range(3) for s in ("convert", "validate", "publish"))
    assert json.loads(rerun.stdout)["jobs_done"] == 3


def test_fetch_step_from_a_hub_then_convert(tmp_path):
    """A job whose source is a repository on a local Hub server: fetch puts the checkpoint in DIR/NAME/finetune/,
    convert reads it from there."""
    from tests.hubserver.harness import FakeHubs, client_env
    from tests.hubserver.server import Repo

    write_random_checkpoint(tmp_path / "ft.safetensors", TINY_FLUX2, seed=3)
    build_demo_base(tmp_path / "base")
    hubs = FakeHubs()
    try:
        hubs.add_hf(Repo("acme/ft", {"ft.safetensors": (tmp_path / "ft.safetensors").read_bytes(),
                                     "README.md": b"# ft\n"}))
        (tmp_path / "jobs.toml").write_text('[[job]]\nname = "hub"\nsource = "hf:acme/ft"\n'
                                            'files = ["ft.safetensors"]\nbase = "base"\n'
                                            'steps = ["fetch", "convert"]\n')
        env = {**client_env(tmp_path, hubs), "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-m", "porting", "batch", "jobs.toml", "--out", "out", "--json"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert [s["state"] for s in doc["jobs"][0]["steps"]] == ["done", "done"]
        assert (tmp_path / "out" / "hub" / "finetune" / "ft.safetensors").is_file()
        assert (tmp_path / "out" / "hub" / "transformer" / "config.json").is_file()
    finally:
        hubs.close()


@pytest.mark.slow  # spawns fresh worker processes twice (each imports torch and diffusers)
def test_a_dead_local_worker_fails_its_step_only_and_the_rerun_retries_it(tmp_path, capsys, monkeypatch):
    for i in range(2):
        write_random_checkpoint(tmp_path / f"s{i}.safetensors", TINY_FLUX2, seed=20 + i)
    (tmp_path / "jobs.toml").write_text('[defaults]\nsteps = ["convert"]\n' + "\n".join(
        f'[[job]]\nname = "j{i}"\nsource = "s{i}.safetensors"\n' for i in range(2)))
    monkeypatch.setenv(TEST_CRASH_ENV, f"j0:convert:{tmp_path / 'crashed'}")
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace.txt"))
    out = tmp_path / "out"
    run = run_port(capsys, "batch", tmp_path / "jobs.toml", "--out", out, "--json")
    assert run.code == 1, run.err
    steps = {j["name"]: j["steps"][0] for j in json.loads(run.out)["jobs"]}
    assert steps["j0"]["state"] == "failed" and steps["j0"]["exit_code"] == 70
    assert "worker process died" in steps["j0"]["error"] and steps["j1"]["state"] == "done"
    again = run_port(capsys, "batch", tmp_path / "jobs.toml", "--out", out, "--json")
    assert again.code == 0 and json.loads(again.out)["steps_run_now"] == 1


@pytest.mark.slow  # two batch runs of convert, validate and publish on the tiny model
def test_a_changed_validate_option_redoes_validate_and_publish_with_the_new_report(tmp_path, capsys, monkeypatch):
    """docs/batch.md: a changed validate option redoes validate and what follows; publish used to be reused (the
    weights and the verdict were the same) and kept the report of the old options."""
    build_demo_base(tmp_path / "base")
    write_random_checkpoint(tmp_path / "a.safetensors", TINY_FLUX2, seed=5)
    jobs = tmp_path / "jobs.toml"

    def write(max_ratio: float) -> None:
        jobs.write_text(f'[defaults]\nbase = "base"\nsteps = ["convert", "validate", "publish"]\n'
                        f'validate = {{ resolution = 64, text-len = 32, timesteps = "0.5", intrinsic = "emulated", '
                        f'max-ratio = {max_ratio} }}\n\n[[job]]\nname = "a"\nsource = "a.safetensors"\n')

    trace = tmp_path / "trace.txt"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    write(2.0)
    out = tmp_path / "out"
    assert run_port(capsys, "batch", jobs, "--out", out, "--executor", "local").code == 0
    assert _trace(trace) == ["a convert", "a validate", "a publish"]
    write(3.0)
    assert run_port(capsys, "batch", jobs, "--out", out, "--executor", "local").code == 0
    assert _trace(trace)[3:] == ["a validate", "a publish"]  # convert reused; publish follows the new report
    published = json.loads(next(out.rglob("published/report.json")).read_text())
    assert published["rule"]["max_ratio"] == 3.0
    assert run_port(capsys, "batch", jobs, "--out", out, "--executor", "local").code == 0
    assert len(_trace(trace)) == 5  # nothing changed: nothing redone


def test_the_summary_on_a_terminal_is_tables_not_markdown(tmp_path, capsys, monkeypatch):
    """Without --json the summary is a line and two tables (batch.md keeps the Markdown): no `| job |` rows or
    `# port batch` heading on stdout, every line within 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")
    build_demo_base(tmp_path / "base")
    write_random_checkpoint(tmp_path / "a.safetensors", TINY_FLUX2, seed=5)
    (tmp_path / "jobs.toml").write_text('[[job]]\nname = "a"\nsource = "a.safetensors"\nbase = "base"\n'
                                        'steps = ["convert"]\n')
    run = run_port(capsys, "batch", tmp_path / "jobs.toml", "--out", tmp_path / "out")
    assert run.code == 0, run.msg
    assert "# port batch" not in run.out and "| job |" not in run.out and "|---|" not in run.out, run.out
    assert "jobs done 1, failed 0" in " ".join(run.out.split()) and "convert" in run.out and "done" in run.out
    assert all(len(line) <= 80 for line in run.out.splitlines()), run.out
    assert "| a | convert | done |" in (tmp_path / "out" / "_batch" / "batch.md").read_text()
