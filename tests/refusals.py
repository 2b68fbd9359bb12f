"""Refusals that need no model, verb by verb: each is made before torch, diffusers or transformers is imported, at
about the cost of `port VERB --help`. Shared by tests/test_cli_refusals.py (which checks the imports) and
bench/startup.py (which times each against --help).

`{model}` stands for an existing folder (nothing in it is read before these refusals), `{out}` for a path that does
not exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "diffusers", "transformers")

# verb -> [(argv after the verb, a phrase of the refusal)]
REFUSALS: dict[str, list[tuple[list[str], str]]] = {
    "publish": [
        (["--base", "{model}", "--transformer", "{model}", "--out", "{out}", "--push", "noslash"],
         "is not a repository id of the form ORG/NAME"),
        (["--base", "{model}", "--transformer", "{model}", "--out", "{out}", "--public"],
         "--public only apply with --push"),
        (["--base", "{model}", "--transformer", "{model}", "--out", "{out}", "--push", "a/b", "--skip-validation"],
         "--push with --skip-validation"),
        (["--base", "{model}", "--out", "{out}"], "port publish needs --transformer"),
        (["recipe", "--base", "{model}"], "give either a RECIPE or --base/--transformer"),
    ],
    "export": [
        (["{model}", "--out", "{out}", "--target", "ryzenai", "--size", "100"], "--size 100: a multiple of 16"),
        (["{model}", "--out", "{out}", "--target", "ryzenai", "--size", "512", "--size", "512"], "given twice"),
        (["{model}", "--out", "{out}", "--size", "512"], "only with --target ryzenai"),
        (["{model}", "--out", "{out}", "--target", "ryzenai", "--dtype", "fp16"], "sets the dtypes itself"),
        (["{model}", "--out", "{out}", "--target", "ryzenai", "--accuracy-level", "9"], "--accuracy-level 9"),
        (["{model}", "--out", "{out}", "--components", ","], "--components is empty"),
        (["{model}", "--check", "{model}"], "--check DIR lints a folder"),
        (["{model}", "--out", "{out}", "--dtype", "bf16"], "--dtype bf16: onnxruntime's CPU execution provider"),
        (["{model}", "--out", "{out}", "--target", "ryzenai", "--opset", "18"], "--opset 18: --target ryzenai"),
    ],
    "validate": [
        (["{model}", "--devices", "cuda:0"], "a pipeline needs two or more devices"),
        (["{model}", "--devices", "cuda:0,npu:1"], "mixes device types"),
        (["{model}", "--devices", "cpu,cpu", "--device", "cpu"], "give the devices once"),
        (["{model}", "--reference", "tpu"], "--reference: Unknown device 'tpu'"),
        (["{model}", "--device", "gpu:0"], "--device: Unknown device 'gpu:0'"),
        (["{model}", "--dtype", "int3"], "--dtype 'int3' is not one of"),
        (["{model}", "--golden-dtype", "fp8"], "--golden-dtype 'fp8' is not one of"),
        (["{model}", "--runtime", "tensorrt"], "--runtime 'tensorrt'"),
        (["{model}", "--intrinsic", "maybe"], "--intrinsic 'maybe'"),
        (["{model}", "--seeds", ""], "--seeds ''"),
        (["{model}", "--timesteps", "2"], "--timesteps 2.0"),
        (["{model}", "--resolution", "8"], "--resolution 8"),
        (["{model}", "--text-len", "0"], "--text-len 0"),
        (["{model}", "--ort-threads", "2"], "--ort-threads 2: only with --runtime onnxruntime"),
    ],
    "compare": [
        (["{model}", "{model}", "--prompt", "x", "--prompts", "{model}"], "give --prompt or --prompts, not both"),
        (["{model}", "{model}", "--size", "abc"], "--size 'abc'"),
        (["{model}", "{model}", "--seeds", "x"], "--seeds 'x'"),
        (["{model}", "{model}", "--device", "gpu"], "--device: Unknown device 'gpu'"),
        (["{model}", "{model}", "--reference-device", "gpu"], "--reference-device: Unknown device 'gpu'"),
        (["{model}", "{model}", "--diff-gain", "0"], "--diff-gain 0.0: must be positive"),
    ],
    "bench": [
        (["{model}", "--card"], "--card compares the base with its 4-bit files"),
        (["{model}", "--offload", "disk"], "--offload 'disk'"),
        (["{model}", "--task", "i2v"], "--task 'i2v'"),
        (["{model}", "--runs", "0"], "--runs 0"),
        (["{model}", "--size", "0"], "sides must be positive"),
        (["{model}", "--device", "gpu"], "--device: Unknown device 'gpu'"),
    ],
    "generate": [
        (["{model}", "--prompt", "x", "--size", "abc"], "--size 'abc'"),
        (["{model}", "--prompt", "x", "--seed", "-1"], "--seed -1"),
        (["{model}", "--prompt", "x", "--device", "gpu"], "--device: Unknown device 'gpu'"),
        (["{model}", "--prompt", "x", "--cpu-offload", "model"], "--cpu-offload moves weights between CPU and"),
        (["{model}", "--prompt", "x", "--output", "{out}.jpg"], "flux-port writes PNG"),
    ],
    "demo": [
        (["--family", "flux3"], "--family 'flux3'"),
    ],
}

# one child interpreter runs a verb's refusals in turn through `port`'s entry, noting after each its exit code, its
# JSON error and which heavy modules are loaded by then
_CHILD = """\
import contextlib, io, json, sys
from porting.cli.app import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    results.append({"code": code, "out": out.getvalue(), "heavy": [m for m in %r if m in sys.modules]})
print(json.dumps(results))
""" % (HEAVY,)


def filled(argv: list[str], model: Path, out: Path) -> list[str]:
    return [a.format(model=model, out=out) for a in argv]


def run_in_child(argvs: list[list[str]], cwd: Path) -> list[dict]:
    """Each command line run in turn in one fresh interpreter: [{code, out, heavy}]."""
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argvs)], capture_output=True, text=True,
                         cwd=cwd, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
