"""Benchmark writing SVDQuant at klein-9B shapes: bf16 -> svdq-int4, and a rank-64 LoRA merged into the result.

    python bench/svdq_write.py --workdir /work/bench-svdq           # 8 + 24 blocks: ~18 GB bf16 source
    python bench/svdq_write.py --blocks 1,2 --workdir /tmp           # same widths, fewer blocks, a quick look
    python bench/svdq_write.py --precision nvfp4 --rank 32

The source is a synthetic klein-9B-shaped checkpoint in diffusers naming (bf16, `write_random_checkpoint` with
`fill="tiled"`: Gaussian values cut from one random pool); making it is not measured. Each measured step is a child
process under GNU time (wall, peak RSS):

  (a) `port convert SRC --quantize svdq-int4 --rank 32 --out DIR --json`: data-free quantization, streamed one
      layer at a time, then the reread of the written file through the reader (part of the command);
  (b) `port merge SVDQ_FILE LORA --out DIR --json` with a rank-64 LoRA (bench/merge.py's, kohya keys of the
      diffusers module names) on every 2-D weight: factors
      appended to the low-rank branches (rank 32 -> 96), 16-bit tensors merged, everything else copied.

Targets (issue 32): (a) peak RSS <= 3 GiB. Needs about 30 GB free on --workdir; the files are deleted afterwards
unless --keep. Not part of CI. Run it under `flock /work/bench.lock` on a shared machine; the load averages are
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import merge as merge_bench  # noqa: E402  (bench/merge.py, same folder)

GIB = 2**30
TARGET_RSS_GIB = 3.0


def measure(cmd: list[str], log: Path) -> dict[str, float]:
    """bench/merge.py's GNU time run, refused on a failure (the log holds the output)."""
    res = merge_bench.measure(cmd, log)
    if res["code"]:
        raise SystemExit(f"{' '.join(cmd)} failed ({res['code']}); see {log}")
    return res


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("int4", "nvfp4"), default="int4")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--blocks", help="D,S: double and single block counts (default 8,24: klein-9B)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    from porting.demo.tiny import model_shapes, write_random_checkpoint
    from tests.svdqfiles import KLEIN9B_CONFIG, _full_config

    config = _full_config("flux2", KLEIN9B_CONFIG)
    if args.blocks:
        config["num_layers"], config["num_single_layers"] = (int(b) for b in args.blocks.split(","))
    work = Path(tempfile.mkdtemp(prefix="svdq-write-", dir=args.workdir))
    port = [sys.executable, "-m", "porting"]
    try:
        t = time.perf_counter()
        src = work / "src"
        src.mkdir()
        write_random_checkpoint(src / "diffusion_pytorch_model.safetensors", config, naming="diffusers",
                                fill="tiled")
        (src / "config.json").write_text(json.dumps(config))
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        print(f"made a klein-shaped bf16 source ({config['num_layers']} + {config['num_single_layers']} blocks): "
              f"{size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s (not measured)", flush=True)
        os.sync()
        print(f"uptime before (a): {uptime()}", flush=True)
        out = work / "svdq"
        a = measure([*port, "convert", str(src), "--quantize", f"svdq-{args.precision}", "--rank", str(args.rank),
                     "--out", str(out), "--json"], work / "convert.log")
        doc = json.loads((work / "convert.log").read_text())
        svdq_file = out / doc["file"]
        file_size = svdq_file.stat().st_size
        print(f"(a) convert bf16 -> svdq-{args.precision} r{args.rank}: {a['wall']:.0f} s wall (user {a['user']:.0f} "
              f"s, sys {a['sys']:.0f} s), peak RSS {a['rss']:.2f} GiB (target <= {TARGET_RSS_GIB} GiB: "
              f"{'PASS' if a['rss'] <= TARGET_RSS_GIB else 'MISS'}); file {file_size / 1e9:.2f} GB = "
              f"{file_size / size:.1%} of bf16 {size / 1e9:.2f} GB; reread: {doc['reread']['layout']}", flush=True)
        worst = max(doc["svdq"]["quality"].items(), key=lambda kv: kv[1]["rel_error"])
        print(f"    worst kind {worst[0]}: {100 * worst[1]['rel_error']:.2f} % (plain rounding "
              f"{100 * worst[1]['plain_rel_error']:.2f} %)", flush=True)
        print(f"uptime after (a): {uptime()}", flush=True)

        shapes = model_shapes(config, "diffusers", "flux2")
        lora = work / "lora.safetensors"
        modules = merge_bench.write_lora(lora, shapes, args.lora_rank)  # kohya keys of the diffusers names
        os.sync()
        print(f"uptime before (b): {uptime()}", flush=True)
        b = measure([*port, "merge", str(svdq_file), str(lora), "--out", str(work / "merged"), "--json"],
                    work / "merge.log")
        mdoc = json.loads((work / "merge.log").read_text())
        merged = work / "merged" / mdoc["files"][0]
        print(f"(b) merge rank-{args.lora_rank} LoRA ({modules} modules) into it: {b['wall']:.0f} s wall (user "
              f"{b['user']:.0f} s), peak RSS {b['rss']:.2f} GiB; rank {mdoc['svdq_merge']['base_rank']} -> "
              f"{mdoc['svdq_merge']['rank']}, file {merged.stat().st_size / 1e9:.2f} GB", flush=True)
        print(f"uptime after (b): {uptime()}", flush=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
