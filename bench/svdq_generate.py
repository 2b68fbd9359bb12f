"""Time `port generate` with a packed SVDQuant transformer against the bf16 folder it converts to (issue 40, item 5).

    python bench/svdq_generate.py                       # int4 rank 32, best of 3 alternating runs
    python bench/svdq_generate.py --precision nvfp4 --runs 2
    python bench/svdq_generate.py --forward-blocks none  # only the generate figures
    python bench/svdq_generate.py --forward-blocks full  # bench/svdquant.py's forward at full klein-9B size

The model: klein-9B widths (inner 4096 = 32 heads x 128, mlp_hidden 12288), one double and one single block, with the
demo's text encoder, VAE and scheduler (`write_tiny_base(..., "klein")`; the transformer's in_channels and
joint_attention_dim are the demo's, so the pipeline runs as it is). The SVDQuant file is made by deepcompressor's
own packer (tests/svdqfiles.py; random codes, scales and low-rank factors; `pip install --no-deps
deepcompressor-toolkit==0.1.0`), the bf16 folder by `port convert` of it; both are built once under --work.

Each run is a fresh process, `port generate BASE --transformer T --prompt ... --steps 2 --json` with the CPU
defaults otherwise (float32 compute, 256 px), timed by generate's own denoise time, and its peak RSS taken with
`os.wait4`. The three variants (bf16 folder, packed `--svdq-compute w4a16`, packed `w4a4`) run alternating, round
after round, and the best of each is kept: on a shared machine the spread between single runs is wide. Prints
each run, the best, the ratios to bf16 and the targets (denoise <= 1.3x bf16, peak RSS <= 0.6x).

Then bench/svdquant.py's forward figures (one bf16 forward of 256 image + 64 text tokens from the packed file, w4a4
and w4a16, and from the bf16 folder), by default cut to 2 double + 6 single blocks at the same widths: the full
8 + 24 blocks need a 5.5 GB file, an 18 GB bf16 folder and about a quarter of an hour on a 2-core machine. Not part
of CI; run it under `flock /work/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_TIME, TARGET_RSS = 1.3, 0.6
VARIANTS = ("bf16", "w4a16", "w4a4")


def port(*args: str) -> list[str]:
    return [sys.executable, "-m", "porting", *map(str, args)]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def build(work: Path, precision: str, rank: int) -> tuple[Path, Path, Path]:
    """(base folder, SVDQuant file, bf16 transformer folder), made once."""
    from porting.demo.bases import tiny_base, write_tiny_base
    from tests.svdqfiles import KLEIN9B_CONFIG, _write_streamed

    base = work / "base"
    if not (base / "model_index.json").is_file():
        write_tiny_base(base, "klein")
    tiny = tiny_base("klein").transformer
    svdq = work / f"svdq-{precision}_r{rank}-klein9b-widths-1-1.safetensors"
    if not svdq.is_file():
        config = {**KLEIN9B_CONFIG, "num_layers": 1, "num_single_layers": 1,
                  "in_channels": tiny["in_channels"], "joint_attention_dim": tiny["joint_attention_dim"]}
        part = svdq.with_suffix(".part.safetensors")
        _write_streamed(part, config, precision, rank, seed=0, chunk_rows=4096)
        part.rename(svdq)
    bf16 = work / f"bf16-{precision}_r{rank}"
    if not (bf16 / "config.json").is_file():
        subprocess.run(port("convert", svdq, "--out", bf16), check=True, env=env(), capture_output=True)
    return base, svdq, bf16


def generate(base: Path, transformer: Path, compute: str | None, out: Path, steps: int) -> tuple[float, float]:
    """One run in its own process, measured by a wrapper process so its peak RSS is its own (`os.wait4`)."""
    out.unlink(missing_ok=True)
    cmd = port("generate", base, "--transformer", transformer, "--prompt", "a red fox in the snow", "--steps", steps,
               "--output", out, "--json", "--quiet")
    if compute:
        cmd += ["--svdq-compute", compute]
    wrapper = textwrap.dedent("""
        import json, os, subprocess, sys
        p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = p.stdout.read()
        err = p.stderr.read()
        _, status, usage = os.wait4(p.pid, 0)
        print(json.dumps({"code": status >> 8, "out": out, "err": err[-3000:], "rss_kib": usage.ru_maxrss}))
    """)
    done = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env(),
                          check=True)
    doc = json.loads(done.stdout)
    if doc["code"]:
        raise SystemExit(f"{' '.join(cmd)} failed ({doc['code']}):\n{doc['err']}")
    result = json.loads(doc["out"])
    return float(result["denoise_s"]), doc["rss_kib"] / 2**20


def bench_generate(args: argparse.Namespace) -> None:
    base, svdq, bf16 = build(args.work, args.precision, args.rank)
    print(f"model: klein-9B widths, 1 double + 1 single block, {args.precision} rank {args.rank}; "
          f"{svdq.stat().st_size / 1e6:.0f} MB packed file, bf16 folder "
          f"{sum(p.stat().st_size for p in bf16.glob('*.safetensors')) / 1e6:.0f} MB; {args.steps} steps, CPU defaults",
          flush=True)
    runs: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for i in range(args.runs):
        for variant in VARIANTS:
            where, compute = (bf16, None) if variant == "bf16" else (svdq, variant)
            t, rss = generate(base, where, compute, args.work / f"{variant}.png", args.steps)
            runs[variant].append((t, rss))
            print(f"round {i + 1} {variant:<6} denoise {t:6.2f} s  peak RSS {rss:5.2f} GiB  "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    best = {v: (min(t for t, _ in r), min(m for _, m in r)) for v, r in runs.items()}
    t0, m0 = best["bf16"]
    print(f"best of {args.runs} (load averages {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{os.cpu_count()} CPUs):")
    for v in VARIANTS:
        t, m = best[v]
        verdict = "" if v == "bf16" else (f"  time {'PASS' if t / t0 <= TARGET_TIME else 'MISS'} (<= {TARGET_TIME}x), "
                                          f"RSS {'PASS' if m / m0 <= TARGET_RSS else 'MISS'} (<= {TARGET_RSS}x)")
        print(f"  {v:<6} denoise {t:6.2f} s = {t / t0:.2f}x bf16, peak RSS {m:5.2f} GiB = {m / m0:.2f}x{verdict}")


def bench_forward(args: argparse.Namespace) -> None:
    """bench/svdquant.py's forward figures (packed w4a4, w4a16 and the bf16 folder, one forward each)."""
    cmd = [sys.executable, str(ROOT / "bench" / "svdquant.py"), "--precision", args.precision, "--rank", str(args.rank)]
    if args.forward_blocks != "full":
        cmd += ["--blocks", args.forward_blocks]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env=env())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("int4", "nvfp4"), default="int4")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="alternating rounds; the best of each variant is kept")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/flux-port-svdq-generate"))
    ap.add_argument("--forward-blocks", default="2,6",
                    help="bench/svdquant.py's forward: D,S blocks (default 2,6), 'full' (8 + 24) or 'none'")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    bench_generate(args)
    if args.forward_blocks != "none":
        bench_forward(args)


if __name__ == "__main__":
    main()
