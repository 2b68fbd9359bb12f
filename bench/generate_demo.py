"""Time `port generate` of the demo model with default options against the <= 30 s target (issue 21, item 1).

    flock /work/bench.lock python bench/generate_demo.py                  # builds the demo once under --work
    flock /work/bench.lock python bench/generate_demo.py --runs 3

The demo's published folder (`port demo --workdir WORK`) is built once; each run is a fresh process,
`port generate WORK/published --prompt ... --output ...` with no other option (on a CPU: float32, 256 px, the
model's 4 steps), timed wall-clock from process start to exit, so it includes Python start-up, imports and
loading. Prints each run, the median and the target; exit 1 when the median misses it. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 30.0
ROOT = Path(__file__).resolve().parents[1]


def port(*args: str) -> list[str]:
    return [sys.executable, "-m", "porting", *args]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/flux-port-generate-demo"))
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    published = args.work / "published"
    if not (published / "model_index.json").is_file():
        subprocess.run(port("demo", "--workdir", str(args.work)), check=True, env=env, stdout=subprocess.DEVNULL)
    times = []
    for i in range(args.runs):
        image = args.work / f"bench-{i}.png"
        image.unlink(missing_ok=True)
        started = time.perf_counter()
        done = subprocess.run(port("generate", str(published), "--prompt", "a red fox in the snow", "--output",
                                   str(image), "--json"), env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            return done.returncode
        times.append(elapsed)
        print(f"run {i + 1}: {elapsed:.2f} s")
    load = os.getloadavg()
    median = statistics.median(times)
    verdict = "meets" if median <= TARGET_S else "MISSES"
    print(f"port generate of the demo model, default options: median {median:.2f} s over {len(times)} run(s); "
          f"{verdict} the <= {TARGET_S:.0f} s target (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"{os.cpu_count()} CPUs)")
    return 0 if median <= TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
