"""Benchmark `port export --format onnx` at real size, and one onnxruntime CPU transformer step against torch's.

    flock /work/bench.lock python bench/export_onnx.py                    # klein-4B shapes, fp16
    flock /work/bench.lock python bench/export_onnx.py --torch-dtypes fp16,bf16 --workdir /work/scratch/issue12/b
    flock /work/bench.lock python bench/export_onnx.py --target ryzenai --model klein-4b --size 256 --text-len 512
    flock /work/bench.lock python bench/export_onnx.py --target ryzenai --text-encoder qwen3-4b --text-len 512

A synthetic transformer folder with klein-4B's shapes (diffusers naming, bf16, 7.75 GB, `fill="tiled"` weights as
in bench/convert.py) is generated first; its generation is not measured. Then, each as a child process timed with
wall-clock and its peak RSS (GNU time's %M):

  (a) `port export SRC --format onnx --out OUT --dtype fp16 --components transformer --json` (with --target
      ryzenai: `port export SRC --format onnx --target ryzenai --size S --text-len T --components transformer`,
      static shapes, opset 17, bf16 weights with casts; the one step below then runs at S x S and T tokens);
  (b) one transformer step at 256x256 (256 image tokens, 512 text tokens, batch 1) in onnxruntime's CPU provider
      on the export: session load, then the step;
  (c) the same step in torch (`Flux2Transformer2DModel.from_pretrained(..., dtype)` on CPU) for each of
      --torch-dtypes; the outputs are compared with onnxruntime's (relative L2).

With --text-encoder qwen3-4b|qwen3-8b (ryzenai only) the text encoder is measured instead: a synthetic Qwen3 folder
at that geometry (bf16, `fill="tiled"`, Qwen3-4B 8.0 GB / Qwen3-8B 16.4 GB, `--layers N` to cut it) inside a pipeline
folder whose transformer holds one placeholder tensor, `port export ... --target ryzenai --components text_encoder`
(hollow trace, every Linear quantized to int4 as it is read), then one text-encoder call of --text-len tokens in
onnxruntime's CPU provider.

Not part of CI. Needs about 2.2 x 7.75 GB of free disk in --workdir; everything is deleted afterwards.
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

GIB = 2**30

STEP_INPUTS = textwrap.dedent("""
    import torch
    from diffusers import Flux2KleinPipeline
    import os
    SIDE, TEXT = int(os.environ.get("BENCH_SIDE", 16)), int(os.environ.get("BENCH_TEXT", 512))
    def step_inputs(cfg, dtype, side=SIDE, text=TEXT):
        gen = torch.Generator().manual_seed(0)
        ctx = torch.randn(1, text, cfg["joint_attention_dim"], generator=gen)
        return {"hidden_states": torch.randn(1, side * side, cfg["in_channels"], generator=gen).to(dtype),
                "encoder_hidden_states": ctx.to(dtype), "timestep": torch.full((1,), 0.5).to(dtype),
                "img_ids": Flux2KleinPipeline._prepare_latent_ids(torch.empty(1, 1, side, side)),
                "txt_ids": Flux2KleinPipeline._prepare_text_ids(ctx)}
""")

ORT_SCRIPT = STEP_INPUTS + textwrap.dedent("""
    import json, sys, time
    import numpy as np, onnxruntime as ort
    folder, cfg_path, out = sys.argv[1:4]
    cfg = json.load(open(cfg_path))
    from porting.export.ort import SessionSettings, open_session
    t0 = time.perf_counter()
    threads = int(os.environ["BENCH_ORT_THREADS"]) if os.environ.get("BENCH_ORT_THREADS") else None
    how = os.environ.get("BENCH_ORT", "lean")
    settings = SessionSettings(threads=threads, lean=how != "default", prepack=how != "lean-unpacked")
    session = open_session(folder, settings=settings)  # what port validate / port generate open
    load = time.perf_counter() - t0
    dtype = torch.float16 if session.get_inputs()[0].type == "tensor(float16)" else torch.float32
    feed = {k: v.numpy() for k, v in step_inputs(cfg, dtype).items()}
    t0 = time.perf_counter()
    (y,) = session.run(None, feed)
    step = time.perf_counter() - t0
    np.save(out, y.astype(np.float32))
    print(json.dumps({"load_s": load, "step_s": step, "finite": bool(np.isfinite(y).all())}))
""")

ORT_TEXT_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np, onnxruntime as ort
    path, text = sys.argv[1], int(sys.argv[2])
    from pathlib import Path
    from porting.export.ort import SessionSettings, open_session
    t0 = time.perf_counter()
    threads = int(os.environ["BENCH_ORT_THREADS"]) if os.environ.get("BENCH_ORT_THREADS") else None
    how = os.environ.get("BENCH_ORT", "lean")
    settings = SessionSettings(threads=threads, lean=how != "default", prepack=how != "lean-unpacked")
    session = open_session(Path(path).parent, file=Path(path).name, settings=settings)
    load = time.perf_counter() - t0
    ids = np.random.default_rng(0).integers(0, 1000, (1, text), dtype=np.int64)
    t0 = time.perf_counter()
    (y,) = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    step = time.perf_counter() - t0
    print(json.dumps({"load_s": load, "step_s": step, "finite": bool(np.isfinite(y).all())}))
""")

TORCH_SCRIPT = STEP_INPUTS + textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from diffusers import Flux2Transformer2DModel
    folder, dtype_name, out = sys.argv[1:4]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    t0 = time.perf_counter()
    model = Flux2Transformer2DModel.from_pretrained(folder, dtype=dtype).eval()
    load = time.perf_counter() - t0
    x = step_inputs(dict(model.config), dtype)
    t0 = time.perf_counter()
    with torch.no_grad():
        y = model(**x, return_dict=False)[0]
    step = time.perf_counter() - t0
    np.save(out, y.float().numpy())
    print(json.dumps({"load_s": load, "step_s": step, "finite": bool(torch.isfinite(y).all())}))
""")


def measure(cmd: list[str], log: Path) -> tuple[float, float, int]:
    """(wall seconds, peak RSS GiB, exit code) of `cmd` run under GNU time."""
    rss_file = log.with_suffix(".rss")
    wrapped = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file)] + cmd
    with open(log, "wb") as out:
        start = time.perf_counter()
        code = subprocess.call(wrapped, stdout=out, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
    kib = int(rss_file.read_text().split()[-1]) if rss_file.exists() else 0
    return wall, kib * 1024 / GIB, code


def last_json(log: Path) -> dict:
    text = log.read_text()
    return json.JSONDecoder().raw_decode(text[text.index("{"):])[0] if "{" in text else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["klein-4b", "klein-9b", "tiny"], default="klein-4b",
                        help="tiny: a smoke test of this script")
    parser.add_argument("--dtype", choices=["fp16", "fp32"], default="fp16")
    parser.add_argument("--opset", type=int, default=None, help="default: 18 (generic), 17 (ryzenai)")
    parser.add_argument("--target", choices=["generic", "ryzenai"], default="generic")
    parser.add_argument("--size", type=int, default=256, help="ryzenai: the static image size (and the step's)")
    parser.add_argument("--text-len", type=int, default=512, help="ryzenai: the static text length (and the step's)")
    parser.add_argument("--torch-dtypes", default="fp16,bf16", help="torch steps to compare with (comma-separated)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--text-encoder", choices=["qwen3-4b", "qwen3-8b"], default=None,
                        help="ryzenai: measure the int4 text encoder at this geometry instead of the transformer")
    parser.add_argument("--ort-settings", default="lean",
                        help="onnxruntime session settings to measure, comma-separated: lean (SessionSettings(), what "
                             "validate and generate open), lean-unpacked (also no weight prepacking), default "
                             "(onnxruntime's own defaults)")
    parser.add_argument("--layers", type=int, default=None, help="--text-encoder: decoder layers (default: real)")
    parser.add_argument("--export-only", action="store_true", help="measure the export only (no onnxruntime or torch "
                                                                   "step)")
    args = parser.parse_args(argv)

    from porting.demo.tiny import REAL_FLUX2, TINY_FLUX2, write_random_checkpoint

    config = TINY_FLUX2 if args.model == "tiny" else REAL_FLUX2[args.model]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="flux-port-onnx-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()}")
    src, out = work / "transformer", work / "onnx"
    results: dict[str, dict] = {}
    if args.text_encoder:
        try:
            return _text_encoder(args, work, out)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    try:
        start = time.perf_counter()
        write_random_checkpoint(src / "diffusion_pytorch_model.safetensors", config, "diffusers", "BF16", seed=0,
                                fill="tiled")
        (src / "config.json").write_text(json.dumps(config))
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        print(f"generated {args.model} shapes, bf16, {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s "
              "(not measured)")
        port = [sys.executable, "-m", "porting"]
        os.environ["BENCH_SIDE"], os.environ["BENCH_TEXT"] = str(args.size // 16), str(args.text_len)
        if args.target == "ryzenai":
            how = ["--target", "ryzenai", "--size", str(args.size), "--text-len", str(args.text_len)]
        else:
            how = ["--dtype", args.dtype, "--opset", str(args.opset or 18)]
        wall, rss, code = measure(port + ["export", str(src), "--format", "onnx", "--out", str(out), *how,
                                          "--components", "transformer", "--json", "--force"], work / "export.log")
        doc = last_json(work / "export.log")
        results["export"] = {"wall": wall, "rss": rss, "code": code}
        if code != 0:
            print((work / "export.log").read_text()[-3000:], file=sys.stderr)
            _report(results)
            return 1
        data = out / "transformer" / "model.onnx.data"
        results["export"].update({"data_gb": data.stat().st_size / 1e9, "opset": doc.get("opset_produced"),
                                  "inner_s": doc.get("seconds")})
        if args.export_only:
            print(f"load average after: {os.getloadavg()}")
            _report(results)
            return 0
        cfg_path = work / "config-only.json"
        cfg_path.write_text(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}))
        for how in args.ort_settings.split(","):
            os.environ["BENCH_ORT"] = how
            log = work / f"ort-{how}.log"
            wall, rss, code = measure([sys.executable, "-c", ORT_SCRIPT, str(out / "transformer"), str(cfg_path),
                                       str(work / "ort.npy")], log)
            results[f"onnxruntime {how}"] = {"wall": wall, "rss": rss, "code": code, **last_json(log)}
            if code != 0:
                print(log.read_text()[-3000:], file=sys.stderr)
        for name in [d for d in args.torch_dtypes.split(",") if d]:
            log = work / f"torch-{name}.log"
            wall, rss, code = measure([sys.executable, "-c", TORCH_SCRIPT, str(src), name,
                                       str(work / f"torch-{name}.npy")], log)
            row = {"wall": wall, "rss": rss, "code": code, **last_json(log)}
            if code == 0 and (work / "ort.npy").exists():
                import numpy as np

                a, b = np.load(work / "ort.npy").astype(np.float64), np.load(work / f"torch-{name}.npy")
                row["rel_l2_vs_ort"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
            elif code != 0:
                print(log.read_text()[-3000:], file=sys.stderr)
            results[f"torch {name}"] = row
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    _report(results)
    return 0


def _text_encoder(args: argparse.Namespace, work: Path, out: Path) -> int:
    """The ryzenai text encoder at Qwen3-4B / Qwen3-8B geometry: streamed int4 export, then one onnxruntime call."""
    import torch
    from safetensors.torch import save_file

    from porting.demo.tiny import REAL_FLUX2, REAL_QWEN3, write_random_text_encoder

    pipe = work / "pipe"
    geometry = dict(REAL_QWEN3[args.text_encoder])
    if args.layers:
        geometry["num_hidden_layers"] = args.layers
    start = time.perf_counter()
    write_random_text_encoder(pipe / "text_encoder", geometry)
    transformer = {"qwen3-4b": "klein-4b", "qwen3-8b": "klein-9b"}[args.text_encoder]
    (pipe / "transformer").mkdir()
    (pipe / "transformer" / "config.json").write_text(json.dumps(dict(REAL_FLUX2[transformer])))
    save_file({"placeholder": torch.zeros(1)}, pipe / "transformer" / "diffusion_pytorch_model.safetensors")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline",
                                                        "transformer": ["diffusers", "Flux2Transformer2DModel"],
                                                        "text_encoder": ["transformers", "Qwen3ForCausalLM"]}))
    size = sum(f.stat().st_size for f in (pipe / "text_encoder").glob("*.safetensors"))
    print(f"generated {args.text_encoder} ({geometry['num_hidden_layers']} layers), bf16, {size / 1e9:.2f} GB in "
          f"{time.perf_counter() - start:.1f} s (not measured)")
    results: dict[str, dict] = {}
    cmd = [sys.executable, "-m", "porting", "export", str(pipe), "--format", "onnx", "--target", "ryzenai",
           "--text-len", str(args.text_len), "--components", "text_encoder", "--out", str(out), "--json", "--force"]
    wall, rss, code = measure(cmd, work / "export.log")
    results["export"] = {"wall": wall, "rss": rss, "code": code}
    if code != 0:
        print((work / "export.log").read_text()[-3000:], file=sys.stderr)
        _report(results)
        return 1
    graph = next((out / "text_encoder").glob("*.onnx"))
    results["export"]["data_gb"] = Path(str(graph) + ".data").stat().st_size / 1e9
    if not args.export_only:
        for how in args.ort_settings.split(","):
            os.environ["BENCH_ORT"] = how
            log = work / f"ort-{how}.log"
            wall, rss, code = measure([sys.executable, "-c", ORT_TEXT_SCRIPT, str(graph), str(args.text_len)], log)
            results[f"onnxruntime {how}"] = {"wall": wall, "rss": rss, "code": code, **last_json(log)}
            if code != 0:
                print(log.read_text()[-3000:], file=sys.stderr)
    print(f"load average after: {os.getloadavg()}")
    _report(results)
    return 0


def _report(results: dict[str, dict]) -> None:
    print()
    for name, r in results.items():
        parts = [f"wall {r['wall']:8.1f} s", f"peak RSS {r['rss']:6.2f} GiB", f"exit {r['code']}"]
        for key, fmt in (("data_gb", "external data {:.2f} GB"), ("opset", "opset {}"),
                         ("load_s", "load {:.1f} s"), ("step_s", "step {:.2f} s"),
                         ("rel_l2_vs_ort", "rel-L2 vs onnxruntime {:.2e}"), ("finite", "finite {}")):
            if r.get(key) is not None:
                parts.append(fmt.format(r[key]))
        print(f"{name + ':':<18} " + "   ".join(parts))


if __name__ == "__main__":
    raise SystemExit(main())
