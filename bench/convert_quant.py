"""Benchmark `port convert` from quantized sources at real size: wall time against `cp` of the output, peak RSS.

    python bench/convert_quant.py                               # klein-9B: ComfyUI scaled fp8 and GGUF Q8_0 -> bf16
    python bench/convert_quant.py --model klein-4b --source gguf-q8_0

Each source is generated with the real shapes (not measured): ComfyUI's legacy scaled-fp8 layout (block linears
e4m3fn with `scale_weight` / `scale_input`, `model.diffusion_model.` prefix, the rest bf16; about 9.4 GB for
klein-9B) or a city96-style GGUF (block linears Q8_0, 1-D tensors F32, the rest BF16; about 9.9 GB), filled by
tiling a small random pool. Then, as child processes timed with wall clock and peak RSS (GNU time):

  (a) `port convert SRC --out DIR --strict --json` (dequantized to bf16, the default for a quantized source);
  (b) `cp -r DIR COPY`: a copy of the output's size on the same disk, the target's yardstick.

Page cache: synced and the files' pages dropped (posix_fadvise) before each run. Targets: convert wall <= 1.5 x cp
of the output, peak RSS <= 1 GiB. Needs about 4.9 x the source size free under --workdir; files are deleted.
Run under `flock /work/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 1.5
TARGET_RSS_GIB = 1.0
SOURCES = ("scaled-fp8", "gguf-q8_0")


def _plain_bench():
    """bench/convert.py's measuring helpers (page-cache dropping, timed children)."""
    spec = importlib.util.spec_from_file_location("flux_port_bench_convert", Path(__file__).with_name("convert.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_scaled_fp8(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    import torch

    from porting.demo.tiny import POOL_SIZE, tiled_tensor
    from porting.tensors.export import quantizable
    from porting.tensors.writer import Entry, write_shards

    prefix = "model.diffusion_model."
    gen = torch.Generator().manual_seed(0)
    pool16 = (0.02 * torch.randn(POOL_SIZE, generator=gen)).to(torch.bfloat16)
    pool8 = (8 * torch.randn(POOL_SIZE, generator=gen)).to(torch.float8_e4m3fn).view(torch.uint8)
    entries, items = [], []
    for i, (key, shape) in enumerate(shapes.items()):
        offset = (7919 * i) % POOL_SIZE
        if quantizable(key, shape, 1):
            layer = key[: -len("weight")]
            entries += [Entry(prefix + key, shape, "F8_E4M3"), Entry(prefix + layer + "scale_weight", (), "F32"),
                        Entry(prefix + layer + "scale_input", (), "F32")]
            items += [("fp8", shape, offset), ("scale", 0.002), ("scale", 1.0)]
        else:
            entries.append(Entry(prefix + key, shape, "BF16"))
            items.append(("bf16", shape, offset))
    entries.append(Entry(prefix + "scaled_fp8", (0,), "F8_E4M3"))
    items.append(("marker",))

    def tensors():
        for item in items:
            if item[0] == "fp8":
                yield tiled_tensor(item[1], pool8, item[2]).view(torch.float8_e4m3fn)
            elif item[0] == "bf16":
                yield tiled_tensor(item[1], pool16, item[2])
            elif item[0] == "scale":
                yield torch.tensor(item[1], dtype=torch.float32)
            else:
                yield torch.empty(0, dtype=torch.float8_e4m3fn)

    write_shards(path.parent, path.stem, entries, tensors(), 2**62, metadata={"format": "pt"})


def write_gguf_q8_0(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    import gguf
    import numpy as np

    from porting.tensors.export import gguf_file

    kinds = gguf_file.kinds(list(shapes.items()), "Q8_0", "BF16")
    rng = np.random.default_rng(0)
    q8_pool = gguf.quants.quantize((0.02 * rng.standard_normal(2**20)).astype(np.float32),
                                   gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    bf16_pool = gguf.quants.quantize((0.02 * rng.standard_normal(2**20)).astype(np.float32),
                                     gguf.GGMLQuantizationType.BF16).reshape(-1)
    writer = gguf.GGUFWriter(str(path), "flux")
    for key, shape in shapes.items():
        qtype = gguf.GGMLQuantizationType[kinds[key]]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor_info(key, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(key, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (key, shape) in enumerate(shapes.items()):
        qtype = gguf.GGMLQuantizationType[kinds[key]]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.write_tensor_data((0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
        pool = q8_pool if qtype == gguf.GGMLQuantizationType.Q8_0 else bf16_pool
        unit = 34 if qtype == gguf.GGMLQuantizationType.Q8_0 else 2  # whole blocks / values only
        n = int(np.prod(byte_shape))
        start = ((7919 * i) % (pool.size // unit - 1)) * unit
        writer.write_tensor_data(np.resize(np.roll(pool, -start), n).reshape(byte_shape))
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["klein-4b", "klein-9b"], default="klein-9b")
    parser.add_argument("--source", choices=SOURCES, action="append", help="default: both")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="N convert / cp pairs per source; the verdict is on the median ratio")
    args = parser.parse_args(argv)
    sources = args.source or list(SOURCES)
    bench = _plain_bench()

    from porting.demo.tiny import REAL_FLUX2, model_shapes

    shapes = model_shapes(REAL_FLUX2[args.model], "original")
    out_bytes = sum(2 * math.prod(s) for s in shapes.values())
    work = args.workdir or Path(tempfile.mkdtemp(prefix="flux-port-bench-quant-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"flux-port quantized convert benchmark: {args.model} shapes, {len(shapes)} tensors, output bf16 "
          f"{out_bytes / 1e9:.2f} GB, in {work} ({shutil.disk_usage(work).free / 1e9:.0f} GB free); "
          f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    port = [sys.executable, "-m", "porting"]
    rows = []
    try:
        for name in sources:
            src = work / ("klein.safetensors" if name == "scaled-fp8" else "klein-Q8_0.gguf")
            start = time.perf_counter()
            (write_scaled_fp8 if name == "scaled-fp8" else write_gguf_q8_0)(src, shapes)
            print(f"[{name}] generated {src.name}: {src.stat().st_size / 1e9:.2f} GB in "
                  f"{time.perf_counter() - start:.0f} s (not measured)")
            out, copy = work / "converted", work / "copy"
            for _ in range(args.repeat):  # convert and cp alternate, so a slow spell of the disk hits both
                bench.drop_from_page_cache(src)
                print(f"[{name}] convert: source resident in page cache before the run: "
                      f"{bench.resident_share(src)}")
                wall, rss, code = bench.measure(port + ["convert", str(src), "--out", str(out), "--strict",
                                                        "--json", "--force"], work / "convert.log")
                log = (work / "convert.log").read_text()
                if code != 0:
                    print(log[-3000:], file=sys.stderr)
                    return 1
                doc = json.loads(log[log.index("{"):])
                sync = bench.timed_sync()
                print(f"[{name}] {doc['dequantized_from']}; {doc['target_tensors']} tensors written, "
                      f"{doc['output_bytes'] / 1e9:.2f} GB")
                bench.drop_from_page_cache(out)
                wall_cp, rss_cp, code = bench.measure(["cp", "-r", str(out), str(copy)], work / "cp.log")
                assert code == 0, (work / "cp.log").read_text()
                sync_cp = bench.timed_sync()
                shutil.rmtree(out)
                shutil.rmtree(copy)
                rows.append((name, wall, sync, rss, doc["seconds"], wall_cp, sync_cp))
            src.unlink()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for p in ("klein.safetensors", "klein-Q8_0.gguf", "converted", "copy"):
                target = work / p
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)

    print()
    for name, wall, sync, rss, inner, wall_cp, sync_cp in rows:
        ratio = wall / wall_cp
        print(f"{name:<11} convert wall {wall:7.2f} s (+ sync {sync:5.2f} s; conversion itself {inner:.2f} s), "
              f"peak RSS {rss:.2f} GiB | cp -r of the output {wall_cp:7.2f} s (+ sync {sync_cp:5.2f} s): {ratio:.2f}x")
    for name in sources:
        mine = [r for r in rows if r[0] == name]
        ratio = statistics.median(r[1] / r[5] for r in mine)
        rss = max(r[3] for r in mine)
        print(f"{name:<11} ratio {ratio:.2f}x cp" + (f" (median of {len(mine)})" if len(mine) > 1 else "")
              + f"; target <= {TARGET_RATIO}x: {'PASS' if ratio <= TARGET_RATIO else 'MISS'}; peak RSS {rss:.2f} "
              f"GiB, target <= {TARGET_RSS_GIB} GiB: {'PASS' if rss <= TARGET_RSS_GIB else 'MISS'}")
    print(f"load average at the end {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
