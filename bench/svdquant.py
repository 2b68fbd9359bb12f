"""Benchmark a klein-9B-shaped Nunchaku SVDQuant file: convert to bf16, and one transformer forward from it.

    python bench/svdquant.py                          # int4 rank 32, 8 + 24 blocks (~5.6 GB file, ~18 GB bf16 out)
    python bench/svdquant.py --precision nvfp4
    python bench/svdquant.py --blocks 1,2             # cut the block counts (same widths) for a quick look
    python bench/svdquant.py --skip-forward           # convert figures only
    python bench/svdquant.py --device cuda --tokens 4096   # the forwards on a GPU (1024x1024), after a warm-up

The file is made by deepcompressor's own packer (tests/svdqfiles.py `write_klein9b_shaped`, random codes, scales
and low-rank factors; needs `pip install --no-deps deepcompressor-toolkit==0.1.0`); making it is not what is
measured. Each measured step runs as a child process timed with wall-clock and its own peak RSS (`os.wait4`):

  (a) `port convert SRC --out DIR --strict --json` (SVDQuant -> bf16 diffusers), page cache of SRC dropped first;
  (b) `cp` of the bf16 file convert wrote, to another file on the same disk, page cache dropped first:
      the ratio (a) / (b) says what dequantizing costs over writing the same bytes; both also with the `sync`
      that writes their dirty pages back (cp's in-kernel copy otherwise ends while 18 GB are still in memory);
  (c) one transformer forward at klein-9B shapes (`--tokens` image tokens, `--text` text tokens, bf16) from the
      packed file (`--svdq-compute w4a4` and `w4a16`, weights kept packed), and from the bf16 folder (a);
      each with its load time, forward time and peak RSS.

Targets (issue 27): convert peak RSS <= 2 GiB. Needs about 1.5 x 18 GB free on --workdir; the files are deleted
afterwards unless --keep. Not part of CI. Run it under `flock /work/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.svdqfiles
from convert import drop_from_page_cache  # noqa: E402  (bench/convert.py, same folder)

GIB = 2**30
TARGET_RSS_GIB = 2.0


def run_child(cmd: list[str]) -> tuple[float, float, str]:
    """(wall, peak RSS GiB of this child alone, stdout): each measured step in a fresh helper process."""
    wrapper = textwrap.dedent("""
        import os, subprocess, sys, time, json
        t = time.perf_counter()
        p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        out, err = p.stdout.read(), p.stderr.read()
        print(json.dumps({"wall": time.perf_counter() - t, "rss_kib": usage.ru_maxrss, "code": status >> 8,
                          "out": out, "err": err[-3000:]}))
    """)
    res = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    doc = json.loads(res.stdout)
    if doc["code"]:
        raise SystemExit(f"{' '.join(cmd)} failed ({doc['code']}):\n{doc['err']}")
    return doc["wall"], doc["rss_kib"] / 2**20, doc["out"]


def synced() -> float:
    """Seconds `sync` takes: the dirty pages a step left behind are part of its cost."""
    t = time.perf_counter()
    os.sync()
    return time.perf_counter() - t


FORWARD = textwrap.dedent("""
    import json, sys, time, torch
    src, compute, tokens, text, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[6]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if compute == "bf16":
        from diffusers import Flux2Transformer2DModel
        model = Flux2Transformer2DModel.from_pretrained(src, torch_dtype=torch.bfloat16)
    else:
        from porting.runtime.svdq_model import load_svdq_transformer
        model = load_svdq_transformer(src, torch.bfloat16, compute=compute)
    model.eval().to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    load = time.perf_counter() - t0
    cfg = model.config
    side = int(tokens ** 0.5)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.zeros(1), torch.arange(side * 1.0),
                                         torch.arange(tokens // side * 1.0), indexing="ij"), -1).reshape(-1, 4)
    txt_ids = torch.zeros(text, 4)
    txt_ids[:, 3] = torch.arange(text)
    x = torch.randn(1, img_ids.shape[0], cfg.in_channels).bfloat16().to(device)
    ctx = torch.randn(1, text, cfg.joint_attention_dim).bfloat16().to(device)
    img_ids, txt_ids, t = img_ids.to(device), txt_ids.to(device), torch.tensor([0.5], device=device)

    def forward():
        with torch.no_grad():
            return model(hidden_states=x, encoder_hidden_states=ctx, timestep=t, img_ids=img_ids,
                         txt_ids=txt_ids, return_dict=False)[0]

    if device != "cpu":  # the first call on an accelerator pays for kernel selection and workspace allocation
        forward()
        sync()
    t1 = time.perf_counter()
    y = forward()
    sync()
    fwd = time.perf_counter() - t1
    torch.save(y.float(), sys.argv[5])
    gpu = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    print(json.dumps({"load_s": load, "forward_s": fwd, "gpu_peak_gib": gpu}))
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("int4", "nvfp4"), default="int4")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--blocks", help="D,S: double and single block counts (default 8,24: klein-9B)")
    ap.add_argument("--tokens", type=int, default=256, help="image tokens of the forward (default 256: 256x256)")
    ap.add_argument("--text", type=int, default=64, help="text tokens of the forward")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--device", default="cpu", help="where the forwards run (cuda: after one untimed warm-up call)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else None

    from tests.svdqfiles import write_klein9b_shaped

    work = Path(tempfile.mkdtemp(prefix="svdq-bench-", dir=args.workdir))
    port = [sys.executable, "-m", "porting"]
    try:
        t = time.perf_counter()
        src = write_klein9b_shaped(work / "svdq.safetensors", args.precision, args.rank, blocks)
        print(f"made {src.name}: {src.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s "
              f"(deepcompressor's packer; not measured)", flush=True)
        print(f"load averages: {os.getloadavg()}", flush=True)

        out = work / "bf16"
        drop_from_page_cache(src)
        wall, rss, stdout = run_child([*port, "convert", str(src), "--out", str(out), "--strict", "--json"])
        wall_sync = wall + synced()
        doc = json.loads(stdout)
        weights = sorted(out.glob("*.safetensors"))
        size = sum(p.stat().st_size for p in weights)
        print(f"(a) convert SVDQuant {args.precision} -> bf16: {wall:.1f} s wall, peak RSS {rss:.2f} GiB "
              f"(target <= {TARGET_RSS_GIB} GiB: {'PASS' if rss <= TARGET_RSS_GIB else 'MISS'}); "
              f"{doc['dequantized_from']}; wrote {size / 1e9:.2f} GB; with the write-back (sync) {wall_sync:.1f} s",
              flush=True)

        copy = work / "copy.safetensors"
        drop_from_page_cache(*weights)
        cp_wall, cp_rss, _ = run_child(["cp", str(weights[0]), str(copy)])
        cp_sync = cp_wall + synced()
        copy.unlink()
        print(f"(b) cp of the bf16 output: {cp_wall:.1f} s wall, {cp_sync:.1f} s with the write-back; convert / cp = "
              f"{wall / cp_wall:.2f}x, with write-back {wall_sync / cp_sync:.2f}x", flush=True)
        print(f"load averages: {os.getloadavg()}", flush=True)

        if not args.skip_forward:
            outputs = {}
            for compute, where in (("w4a4", src), ("w4a16", src), ("bf16", out)):
                res = work / f"y-{compute}.pt"
                wall, rss, stdout = run_child([sys.executable, "-c", FORWARD, str(where), compute, str(args.tokens),
                                               str(args.text), str(res), args.device])
                d = json.loads(stdout.strip().splitlines()[-1])
                outputs[compute] = res
                print(f"(c) forward {compute:<6} ({args.tokens} image + {args.text} text tokens): load "
                      f"{d['load_s']:.1f} s, forward {d['forward_s']:.3f} s, peak RSS {rss:.2f} GiB"
                      + (f", {args.device} peak {d['gpu_peak_gib']:.2f} GiB" if d["gpu_peak_gib"] else ""), flush=True)
            import torch

            ref = torch.load(outputs["bf16"])
            for compute in ("w4a4", "w4a16"):
                y = torch.load(outputs[compute])
                print(f"    {compute} vs bf16 of the dequantized weights: relative L2 "
                      f"{((y - ref).norm() / ref.norm()).item():.4f}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
