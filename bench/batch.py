"""Benchmark `port batch` on a batch of tiny jobs, on both executors: wall time and the per-step overhead of Ray.

    python bench/batch.py                      # one job per CPU x (convert, publish --skip-validation)
    python bench/batch.py --jobs 12 --validate # add a tiny validate step to every job

Every job is a tiny FLUX.2 [klein] checkpoint (porting.demo.tiny, random weights) on the tiny offline base
(porting.demo.tinypipe); building them is not measured. Each executor runs `port batch JOBS --out DIR --json` as a
child process, twice: the first run does every step, the second finds every step in the journal and runs none
(its wall time is the fixed cost: interpreter, imports, the journal, and for Ray starting a local cluster).
Both executors get the same number of slots (local `--parallel N`, Ray a local cluster of N CPUs via
RAY_ADDRESS unset and num_cpus from the machine: pass --slots to match it).

    per-step overhead of Ray = ((ray first - ray rerun) - (local first - local rerun)) / steps

that is, what a step costs more as a Ray task (submission, scheduling, a worker process, result transfer) than
as a call in a process pool, with the fixed costs taken out; it also carries the difference in what the first step
in each fresh worker pays to import torch and diffusers. The summary's per-step `dispatch_s` (the driver's time for
a step minus the time inside the verb) measures the hand-over directly; its median is printed per executor. Not
part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(work: Path, jobs: int, validate: bool) -> Path:
    sys.path.insert(0, str(ROOT))
    from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint
    from porting.demo.tinypipe import build_demo_base

    build_demo_base(work / "base")
    for i in range(jobs):
        write_random_checkpoint(work / f"ft{i}.safetensors", TINY_FLUX2, seed=100 + i)
    steps = ["convert", "validate", "publish"] if validate else ["convert", "publish"]
    text = [f'[defaults]\nbase = "base"\nsteps = {json.dumps(steps)}']
    text.append('validate = { resolution = 64, text-len = 32, timesteps = "0.5", intrinsic = "emulated" }'
                if validate else "publish = { skip-validation = true }")
    text += [f'[[job]]\nname = "job{i}"\nsource = "ft{i}.safetensors"' for i in range(jobs)]
    path = work / "jobs.toml"
    path.write_text("\n\n".join(text) + "\n")
    return path


def run(jobs_file: Path, out: Path, executor: str, slots: int) -> dict:
    cmd = [sys.executable, "-m", "porting", "batch", str(jobs_file), "--out", str(out), "--json",
           "--executor", executor]
    cmd += ["--parallel", str(slots)] if executor == "local" else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{executor}: exit {done.returncode}\n{done.stderr[-2000:]}")
    doc = json.loads(done.stdout)
    ran = [s for j in doc["jobs"] for s in j["steps"] if s.get("ran_now")]
    dispatch = sorted(s["dispatch_s"] for s in ran)
    return {"wall": wall, "steps_run": doc["steps_run_now"], "in_steps": sum(s["seconds"] for s in ran),
            "dispatch_median": statistics.median(dispatch) if dispatch else 0.0,
            "dispatch_max": max(dispatch) if dispatch else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="default: one per CPU, so that no Ray task waits for a CPU and the dispatch time is "
                         "placement and hand-over only")
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--slots", type=int, default=os.cpu_count() or 1, help="local --parallel (Ray uses every CPU)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        work = Path(tmp)
        jobs_file = build(work, args.jobs, args.validate)
        res = {}
        for executor in ("local", "ray"):
            first = run(jobs_file, work / f"out-{executor}", executor, args.slots)
            again = run(jobs_file, work / f"out-{executor}", executor, args.slots)
            assert again["steps_run"] == 0, again
            res[executor] = (first, again)
            print(f"{executor:5s}: {args.jobs} jobs, {first['steps_run']} steps in {first['wall']:.2f} s wall "
                  f"(sum of time inside the steps {first['in_steps']:.2f} s); rerun (nothing to do) "
                  f"{again['wall']:.2f} s; per step, the driver's time minus the time inside the verb: median "
                  f"{first['dispatch_median'] * 1000:.0f} ms, max {first['dispatch_max'] * 1000:.0f} ms", flush=True)
        steps = res["ray"][0]["steps_run"]
        var = [(f["wall"] - a["wall"]) for f, a in (res["local"], res["ray"])]
        print(f"per-step overhead of Ray over the local pool: {(var[1] - var[0]) / steps * 1000:.0f} ms "
              f"(({res['ray'][0]['wall']:.2f} - {res['ray'][1]['wall']:.2f}) - ({res['local'][0]['wall']:.2f} - "
              f"{res['local'][1]['wall']:.2f})) / {steps} steps; slots: local {args.slots}, ray {os.cpu_count()} "
              "CPUs")
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
