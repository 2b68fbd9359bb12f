"""Benchmark the start-up of `port --help`, `port --version` and `port VERB --help` for every verb.

    python bench/startup.py                # 5 runs of each, medians, as ratios to `import typer, rich`
    python bench/startup.py --repeat 9

Each command is run as a child process (`python -m porting ...`, output to /dev/null) and timed with wall-clock;
the baseline `python -c "import typer, rich"` runs in the same rounds, interleaved with the commands, so a busy
spell of a shared machine hits both. A round runs the baseline and every command once; the figure of each command
is the median of its runs, divided by the baseline's median. Target (issue 33): every ratio <= 1.5.

The machine is shared: run it under `flock /work/bench.lock` and read the load averages it prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # `python -m porting` from here runs this checkout's porting
TARGET = 1.5
BASELINE = "import typer, rich"


def commands() -> list[list[str]]:
    sys.path.insert(0, str(ROOT))
    from porting.cli.app import VERBS  # the table only: no verb module is imported here

    return [["--help"], ["--version"]] + [[verb, "--help"] for verb in VERBS]


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=ROOT,
                   env={**os.environ, "COLUMNS": "80"})
    return time.perf_counter() - start


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="rounds (at least 3)")
    args = parser.parse_args(argv)
    if args.repeat < 3:
        parser.error("--repeat: at least 3 rounds, for a median")
    argvs = commands()
    print(f"flux-port start-up benchmark: {len(argvs)} commands, {args.repeat} rounds; load average {load_average()}")
    base: list[float] = []
    runs: dict[str, list[float]] = {" ".join(a): [] for a in argvs}
    for _ in range(args.repeat):
        for a in argvs:
            base.append(timed([sys.executable, "-c", BASELINE]))
            runs[" ".join(a)].append(timed([sys.executable, "-m", "porting", *a]))
    reference = statistics.median(base)
    print(f"baseline `python -c \"{BASELINE}\"`: median {1000 * reference:.0f} ms of {len(base)} runs")
    worst = 0.0
    for name, times in runs.items():
        ratio = statistics.median(times) / reference
        worst = max(worst, ratio)
        print(f"  port {name:<18} median {1000 * statistics.median(times):5.0f} ms  {ratio:4.2f}x")
    print(f"worst ratio {worst:.2f}x; target <= {TARGET}x: {'PASS' if worst <= TARGET else 'MISS'}; "
          f"load average at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
