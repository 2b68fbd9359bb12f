"""Benchmark the start-up of `port --help`, `port --version` and `port VERB --help` for every verb, and of every
refusal that needs no model (tests/refusals.py) against its verb's `--help`.

    python bench/startup.py                # 5 runs of each, medians, as ratios to `import typer, rich`
    python bench/startup.py --repeat 9
    python bench/startup.py --refusals     # only the refusals: each one's median against `port VERB --help`

Each command is run as a child process (`python -m porting ...`, output to /dev/null) and timed with wall-clock;
the baseline `python -c "import typer, rich"` runs in the same rounds, interleaved with the commands, so a busy
spell of a shared machine hits both. A round runs the baseline and every command once; the figure of each command
is the median of its runs, divided by the baseline's median. Target (issue 33): every ratio <= 1.5.

The refusals (publish --push noslash, export --target ryzenai --size 100, validate --devices cuda:0, ...) are made
before torch, diffusers or transformers is imported: each is timed in rounds with its verb's `--help`, and its
median divided by that help's median. Target: every ratio <= 1.5 (about the cost of --help; they took 3-14 s when
the model libraries were imported first).

The machine is shared: run it under `flock /work/bench.lock` and read the load averages it prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # `python -m porting` from here runs this checkout's porting
TARGET = 1.5
BASELINE = "import typer, rich"


def commands() -> list[list[str]]:
    sys.path.insert(0, str(ROOT))
    from porting.cli.app import VERBS  # the table only: no verb module is imported here

    return [["--help"], ["--version"]] + [[verb, "--help"] for verb in VERBS]


def timed(cmd: list[str], code: int = 0) -> float:
    """Wall-clock seconds of `cmd`, which must exit with `code`."""
    start = time.perf_counter()
    run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                         env={**os.environ, "COLUMNS": "80"})
    seconds = time.perf_counter() - start
    if run.returncode != code:
        raise SystemExit(f"{' '.join(cmd)}: exit {run.returncode}, expected {code}")
    return seconds


def refusals(folder: Path) -> list[tuple[str, list[str]]]:
    """(verb, command line) of every refusal in tests/refusals.py, `{model}` an empty folder."""
    sys.path.insert(0, str(ROOT))
    from tests.refusals import REFUSALS, filled

    (folder / "model").mkdir(exist_ok=True)
    return [(verb, [verb, *filled(argv, folder / "model", folder / "out")])
            for verb, cases in REFUSALS.items() for argv, _ in cases]


def bench_refusals(repeat: int) -> float:
    """Each refusal against its verb's --help, in interleaved rounds; prints the medians, returns the worst ratio."""
    with tempfile.TemporaryDirectory(prefix="flux-port-refusals-") as tmp:
        cases = refusals(Path(tmp))
        verbs = list(dict.fromkeys(verb for verb, _ in cases))
        helps: dict[str, list[float]] = {verb: [] for verb in verbs}
        runs: list[list[float]] = [[] for _ in cases]
        for _ in range(repeat):
            for verb in verbs:
                helps[verb].append(timed([sys.executable, "-m", "porting", verb, "--help"]))
            for i, (_, argv) in enumerate(cases):
                runs[i].append(timed([sys.executable, "-m", "porting", *argv], code=2))
        print(f"refusals before any model library: {len(cases)} commands, {repeat} rounds, each against its verb's "
              "--help")
        worst = 0.0
        for (verb, argv), times in zip(cases, runs):
            help_s = statistics.median(helps[verb])
            ratio = statistics.median(times) / help_s
            worst = max(worst, ratio)
            shown = " ".join("DIR" if a.startswith(tmp) else a for a in argv)
            print(f"  port {shown[:62]:<62} {1000 * statistics.median(times):5.0f} ms  --help "
                  f"{1000 * help_s:4.0f} ms  {ratio:4.2f}x")
        print(f"worst refusal ratio {worst:.2f}x; target <= {TARGET}x: {'PASS' if worst <= TARGET else 'MISS'}")
        return worst


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="rounds (at least 3)")
    parser.add_argument("--refusals", action="store_true", help="only the refusals, against their verb's --help")
    args = parser.parse_args(argv)
    if args.repeat < 3:
        parser.error("--repeat: at least 3 rounds, for a median")
    if args.refusals:
        print(f"load average {load_average()}")
        bench_refusals(args.repeat)
        print(f"load average at the end {load_average()}")
        return 0
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
    print(f"worst ratio {worst:.2f}x; target <= {TARGET}x: {'PASS' if worst <= TARGET else 'MISS'}")
    bench_refusals(args.repeat)
    print(f"load average at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
