"""Benchmark the 4-bit text encoder at Qwen3-8B shapes (klein-9B's): writing it, and running it packed.

    python bench/text_encoder_awq.py --workdir /work/bench-te            # all 36 layers: ~16 GB bf16 source
    python bench/text_encoder_awq.py --layers 8 --workdir /tmp            # a band of 8 layers, same widths

The source is a synthetic Qwen3ForCausalLM folder of Qwen3-8B's geometry (bf16, `write_random_text_encoder`, tiled
Gaussian values, norms at 1); making it is not measured. Each measured step is a child process under GNU time
(wall, peak RSS):

  (a) `port convert SRC --quantize awq-int4 --out DIR --json`: data-free AWQ W4A16 g128, one layer at a time;
  (b) the bf16 encoder (transformers' Qwen3Model from SRC) against the 4-bit file run packed
      (`porting.runtime.awq_text`), each in its own process: load, then the forward of a 512-token prompt as
      klein's pipeline runs it (hidden states of every layer), best of --repeat; alternating, bf16 first.

Targets (issue 39): (a) bounded memory on a 24 GiB machine (the peak is stated); (b) the forward time and RSS of
the packed encoder against bf16. Not part of CI; run it under `flock /work/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import merge as merge_bench  # noqa: E402  (bench/merge.py, same folder)

FORWARD = """
import json, resource, sys, time, torch
torch.manual_seed(0)
kind, path, tokens, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
if kind == "bf16":
    from transformers import Qwen3Model
    model = Qwen3Model.from_pretrained(path, dtype=torch.bfloat16).eval()
else:
    from porting.runtime.awq_text import load_packed_text_encoder
    model = load_packed_text_encoder(path)
load = time.perf_counter() - t
ids = torch.randint(0, 151000, (1, tokens))
best = float("inf")
with torch.no_grad():
    for _ in range(repeat):
        t = time.perf_counter()
        out = model(input_ids=ids, output_hidden_states=True).hidden_states
        best = min(best, time.perf_counter() - t)
print(json.dumps({"load": load, "forward": best, "last": float(out[-1].float().norm())}))
"""


def measure(cmd: list[str], log: Path) -> dict[str, float]:
    res = merge_bench.measure(cmd, log)
    if res["code"]:
        raise SystemExit(f"{' '.join(cmd)} failed ({res['code']}); see {log}")
    return res


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36, help="Qwen3 layers (36: the whole Qwen3-8B)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length of the forward (klein's is 512)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    from porting.demo.tiny import REAL_QWEN3, write_random_text_encoder

    config = {**REAL_QWEN3["qwen3-8b"], "num_hidden_layers": args.layers}
    work = Path(tempfile.mkdtemp(prefix="te-awq-", dir=args.workdir))
    port = [sys.executable, "-m", "porting"]
    try:
        t = time.perf_counter()
        src = write_random_text_encoder(work / "text_encoder", config)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        print(f"made a Qwen3-8B-shaped bf16 source ({args.layers} layers): {size / 1e9:.2f} GB in "
              f"{time.perf_counter() - t:.0f} s (not measured)", flush=True)
        print(f"load before (a): {loadavg()}", flush=True)
        a = measure([*port, "convert", str(src), "--quantize", "awq-int4", "--out", str(work / "q"), "--json"],
                    work / "convert.log")
        doc = json.loads((work / "convert.log").read_text())
        file = work / "q" / doc["file"]
        print(f"(a) convert bf16 -> awq-int4 g128: {a['wall']:.0f} s wall (user {a['user']:.0f} s), peak RSS "
              f"{a['rss']:.2f} GiB; file {file.stat().st_size / 1e9:.2f} GB = {file.stat().st_size / size:.1%} of "
              f"bf16 {size / 1e9:.2f} GB (lm_head left out); worst layer error {100 * doc['worst_rel_l2']:.2f} %",
              flush=True)
        print(f"load after (a): {loadavg()}", flush=True)
        runs: dict[str, list[dict]] = {"bf16": [], "awq": []}
        for _ in range(2):
            for kind, path in (("bf16", src), ("awq", file)):
                log = work / f"forward-{kind}.log"
                r = measure([sys.executable, "-c", FORWARD, kind, str(path), str(args.tokens), str(args.repeat)],
                            log)
                runs[kind].append({**r, **json.loads(log.read_text().strip().splitlines()[-1])})
        best = {k: min(v, key=lambda r: r["forward"]) for k, v in runs.items()}
        rss = {k: min(r["rss"] for r in v) for k, v in runs.items()}
        for kind in ("bf16", "awq"):
            print(f"(b) {kind:4}: forward of {args.tokens} tokens {best[kind]['forward']:.2f} s (load "
                  f"{best[kind]['load']:.1f} s), peak RSS {rss[kind]:.2f} GiB", flush=True)
        print(f"    packed / bf16: time {best['awq']['forward'] / best['bf16']['forward']:.2f}x, peak RSS "
              f"{rss['awq'] / rss['bf16']:.2f}x; load {loadavg()}", flush=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
