"""Benchmark `port merge` of a klein-9B-shaped base with a rank-64 LoRA on every linear layer.

    python bench/merge.py                          # klein-9B shapes, bf16 base (~18.2 GB), kohya LoRA rank 64
    python bench/merge.py --model klein-4b --rank 16
    python bench/merge.py --to diffusers           # merge and convert in one pass
    python bench/merge.py --repeat 3 --keep --workdir /data/bench   # three cp / merge pairs; keep the inputs

The base is synthetic with the real shapes (`porting.demo.tiny.write_random_checkpoint(fill="tiled")`, original
naming, bf16); the LoRA (kohya naming, bf16, alpha = rank / 2) covers every 2-d weight of the base. Their
generation is not measured (with --keep and the same --workdir a later run reuses them). Then, alternating
`--repeat` times, `cp BASE COPY` and `port merge BASE LORA --out DIR --json` run as child processes, timed with the
wall clock and their own peak RSS (GNU time), each after the base's and the LoRA's cached pages were dropped (see
bench/convert.py); the judgement is on the median ratio merge / cp. Targets (issue 22): merge wall <= 1.5 x cp of
the base, peak RSS <= 1 GiB. A spot check after the timing recomputes one merged tensor independently.

The machine is shared: run under `flock /work/bench.lock` and read the load averages printed. Needs about 2.1 x
the base size free under --workdir; everything is deleted afterwards (but the inputs, with --keep). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import drop_from_page_cache, resident_share, timed_sync  # noqa: E402  (bench/convert.py)

GIB = 2**30
TARGET_RATIO = 1.5
TARGET_RSS_GIB = 1.0
SPOT = "double_blocks.0.img_attn.proj.weight"  # one merged tensor recomputed independently after the timing


def measure(cmd: list[str], log: Path) -> dict[str, float]:
    """Run `cmd` under GNU time: wall, user and system CPU seconds, peak RSS (GiB), exit code."""
    stats = log.with_suffix(".time")
    with open(log, "wb") as out:
        code = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", str(stats)] + cmd, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    wall, user, system, kib = stats.read_text().split()[-4:]
    return {"wall": float(wall), "user": float(user), "sys": float(system), "rss": int(kib) * 1024 / GIB,
            "code": code}


def write_lora(path: Path, shapes: dict[str, tuple[int, ...]], rank: int) -> int:
    """A kohya LoRA on every 2-d weight; returns its module count."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for key, shape in shapes.items():
        if len(shape) != 2 or not key.endswith(".weight"):
            continue
        stem = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
        out, inp = shape
        tensors[stem + ".lora_down.weight"] = (torch.randn(rank, inp, generator=gen) / inp ** 0.5).bfloat16()
        tensors[stem + ".lora_up.weight"] = (0.01 * torch.randn(out, rank, generator=gen)).bfloat16()
        tensors[stem + ".alpha"] = torch.tensor(rank / 2)
    save_file(tensors, str(path))
    return len(tensors) // 3


def spot_check(base: Path, lora: Path, out: Path, key: str, rank: int) -> tuple[float, float]:
    """For one tensor, recomputed here with safetensors alone as bf16(W + alpha / r * up @ down): the largest
    difference in bf16 ulps of the value and the share of elements that are bit-equal."""
    import torch
    from safetensors import safe_open

    stem = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
    with safe_open(str(base), "pt") as f:
        w = f.get_tensor(key)
    with safe_open(str(lora), "pt") as f:
        up, down = f.get_tensor(stem + ".lora_up.weight"), f.get_tensor(stem + ".lora_down.weight")
    want = (w.float() + (rank / 2) / rank * (up.float() @ down.float())).to(w.dtype)
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if key in f.keys():
                got = f.get_tensor(key)
                ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-30)
                ulps = ((got.float() - want.float()).abs() / ulp).max().item()
                return ulps, (got == want).float().mean().item()
    raise AssertionError(f"{key} not in the output")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["klein-4b", "klein-9b", "flux2-dev"], default="klein-9b")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--to", choices=["keep", "diffusers"], default="keep")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="N alternating cp / merge pairs")
    parser.add_argument("--keep", action="store_true", help="keep (and reuse) the generated base and LoRA")
    parser.add_argument("--blocks", default=None, metavar="D,S",
                        help="cut the model to D double and S single blocks (same widths: the per-tensor work of "
                             "the full model on a smaller file)")
    args = parser.parse_args(argv)

    from porting.demo.tiny import REAL_FLUX2, model_shapes, write_random_checkpoint

    config = dict(REAL_FLUX2[args.model])
    if args.blocks:
        double, single = (int(n) for n in args.blocks.split(","))
        config.update(num_layers=double, num_single_layers=single)
    shapes = model_shapes(config, "original")
    size = sum(2 * math.prod(s) for s in shapes.values())
    work = args.workdir or Path(tempfile.mkdtemp(prefix="flux-port-bench-merge-"))
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    stem = args.model + (f"-{args.blocks.replace(',', '-')}" if args.blocks else "")
    base, lora, out = work / f"{stem}.safetensors", work / f"lora-{stem}-r{args.rank}.safetensors", work / "merged"
    reuse = base.is_file() and base.stat().st_size > size and lora.is_file()
    need = (0 if reuse else size) + 1.05 * size
    print(f"flux-port merge benchmark: {args.model} shapes" + (f" cut to {args.blocks} blocks" if args.blocks else "")
          + f", bf16, {len(shapes)} tensors, {size / 1e9:.2f} GB, "
          f"rank-{args.rank} LoRA, in {work} ({free / 1e9:.0f} GB free); load average {load_average()}")
    if free < need:
        print(f"not enough free disk: need {need / 1e9:.1f} GB", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, float]]] = {"cp": [], "merge": []}
    try:
        start = time.perf_counter()
        if not reuse:
            write_random_checkpoint(base, config, "original", "BF16", seed=0, fill="tiled")
            write_lora(lora, shapes, args.rank)
        print(f"{'reused' if reuse else 'generated'} the base and the LoRA ({lora.stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - start:.1f} s (not measured)")
        cmd = [sys.executable, "-m", "porting", "merge", str(base), str(lora), "--out", str(out), "--json", "--force"]
        if args.to != "keep":
            cmd += ["--to", args.to]
        for i in range(args.repeat):  # cp and merge alternate, so a slow spell of the disk hits both
            copy = work / "copy.safetensors"
            drop_from_page_cache(base, lora)
            print(f"cp {i + 1}: base resident in page cache before the run: {resident_share(base)}")
            r = measure(["cp", str(base), str(copy)], work / "cp.log")
            assert r["code"] == 0, (work / "cp.log").read_text()
            runs["cp"].append({**r, "sync": timed_sync()})
            copy.unlink()

            drop_from_page_cache(base, lora)
            print(f"merge {i + 1}: base resident in page cache before the run: {resident_share(base)}")
            r = measure(cmd, work / "merge.log")
            log = (work / "merge.log").read_text()
            if r["code"] != 0:
                print(log[-3000:], file=sys.stderr)
                return 1
            doc = json.loads(log[log.index("{"):])
            runs["merge"].append({**r, "sync": timed_sync(), "inner": doc["seconds"]})
            print(f"merge {i + 1}: wall {r['wall']:.2f} s (merge itself {doc['seconds']:.2f} s), CPU user "
                  f"{r['user']:.1f} s + sys {r['sys']:.1f} s, peak RSS {r['rss']:.2f} GiB, {doc['target_tensors']} "
                  f"tensors, weights_sha256 {doc['weights_sha256'][:16]}; cp {runs['cp'][-1]['wall']:.2f} s")
            if args.to == "keep" and i == 0:
                ulps, equal = spot_check(base, lora, out, SPOT, args.rank)
                print(f"spot check {SPOT}: {equal:.4%} bit-equal to bf16(W + s * B @ A) "
                      f"recomputed here, largest difference {ulps:.2f} bf16 ulp")
            shutil.rmtree(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            base.unlink(missing_ok=True)
            lora.unlink(missing_ok=True)
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
    _report(runs, size)
    return 0


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _report(runs: dict[str, list[dict[str, float]]], size: int) -> None:
    print()
    for name, rs in runs.items():
        for i, r in enumerate(rs):
            print(f"{name} {i + 1}:".ljust(10) + f"wall {r['wall']:8.2f} s   then sync {r['sync']:6.2f} s   "
                  f"throughput {size / r['wall'] / 1e6:6.0f} MB/s   CPU {r['user']:6.1f} s user {r['sys']:5.1f} s sys"
                  f"   peak RSS {r['rss']:5.2f} GiB")
    pairs = list(zip(runs["merge"], runs["cp"]))
    ratios = sorted(m["wall"] / c["wall"] for m, c in pairs)
    ratio = statistics.median(ratios)
    each = ", ".join(f"{m['wall'] / c['wall']:.2f}x" for m, c in pairs)
    print(f"cp median {statistics.median(c['wall'] for c in runs['cp']):.2f} s, merge median "
          f"{statistics.median(m['wall'] for m in runs['merge']):.2f} s")
    print(f"ratio merge/cp: {ratio:.2f}x wall (median of {len(pairs)}: {each}); target <= {TARGET_RATIO}x: "
          f"{'PASS' if ratio <= TARGET_RATIO else 'MISS'}")
    rss = max(m["rss"] for m in runs["merge"])
    verdict = "PASS" if rss <= TARGET_RSS_GIB else "MISS"
    print(f"merge peak RSS: {rss:.2f} GiB; target <= {TARGET_RSS_GIB} GiB: {verdict}")
    print(f"load average at the end {load_average()}")


if __name__ == "__main__":
    sys.exit(main())
