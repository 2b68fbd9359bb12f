"""`port export --check DIR --target T`: a pre-flight lint of any folder of ONNX files (ours or someone else's).

Per graph (every `*.onnx` under DIR, read without its external data): the default-domain opset, symbolic or unknown
dimensions in the graph's inputs and outputs, the dtypes of inputs, outputs and initializers, operators outside the
target's list, and initializers whose bytes sit inside the protobuf file when that file would pass protobuf's 2 GB
limit. Findings are rows (file, check, what); none means the folder passes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from porting.errors import InputError, UsageError

from .ort import require

PROTOBUF_LIMIT = 2**31  # protobuf's message size limit: 2 GB


@dataclass(frozen=True)
class TargetRules:
    name: str
    opset: int | None  # exact default-domain opset, or None for any
    static: bool  # no symbolic or unknown dimension in graph inputs and outputs
    io_dtypes: frozenset[str]  # allowed input/output element types (onnx names)
    initializer_dtypes: frozenset[str]
    ops: frozenset[str] | None  # allowed "domain:op" (default domain written bare), or None for any
    source: str  # where the rules come from


# The operators flux-port's own ryzenai export writes for FLUX.2 klein (transformer, VAE decoder, Qwen3 text
# encoder), all in the default ONNX domain at opset 17, plus com.microsoft MatMulNBits. AMD does not publish one
# operator list for its BF16 / MatMulNBits NPU flow that could be checked here; the Vitis AI EP partitions the graph
# and runs what the NPU does not take on the CPU. So an operator outside this list is flagged as "not in what
# flux-port's ryzenai export writes and has been run through onnxruntime", not as "the NPU cannot run it".
RYZENAI_OPS = frozenset({
    "Add", "And", "Cast", "CastLike", "Concat", "Constant", "Conv", "Cos", "Div", "Expand", "Gather", "GatherND",
    "Gemm", "Identity", "InstanceNormalization", "IsNaN", "LayerNormalization", "MatMul", "Mul", "Neg", "Pow",
    "Reciprocal", "ReduceMean", "Reshape", "Resize", "Sigmoid", "Sin", "Slice", "Softmax", "Split", "Sqrt", "Squeeze",
    "Sub", "Transpose", "Unsqueeze", "Where", "com.microsoft:MatMulNBits",
})

TARGETS = {
    "generic": TargetRules("generic", None, False, frozenset(), frozenset(), None,
                           "no constraint beyond onnx.checker (any opset, dynamic axes allowed)"),
    "ryzenai": TargetRules(
        "ryzenai", 17, True, frozenset({"FLOAT", "INT64", "INT32", "BOOL"}),
        # DOUBLE: diffusers computes FLUX.2's RoPE frequencies in float64 when traced on a CPU (a few small
        # constants); a graph whose inputs and outputs are float32 may hold them
        frozenset({"FLOAT", "BFLOAT16", "UINT8", "INT64", "INT32", "BOOL", "DOUBLE"}), RYZENAI_OPS,
        "Ryzen AI docs (opset 17 recommended, fixed input shapes, BF16 transformer, int4 MatMulNBits text encoder); "
        "operator list: what flux-port's ryzenai export writes (AMD publishes no list for this flow)"),
}


@dataclass
class Finding:
    file: str
    check: str
    detail: str


@dataclass
class LintResult:
    folder: str
    target: str
    files: list[str]
    findings: list[Finding] = field(default_factory=list)
    rules: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.files) and not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "target": self.target, "files": self.files, "ok": self.ok,
                "rules": self.rules, "findings": [asdict(f) for f in self.findings]}


def _dtype_name(elem_type: int) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(elem_type)


def _dims(value: Any) -> list[Any]:
    t = value.type.tensor_type
    if not t.HasField("shape"):
        return [None]
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def lint_file(path: Path, rules: TargetRules, rel: str) -> list[Finding]:
    onnx = require("onnx")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a file that is not ONNX at all
        return [Finding(rel, "load", f"not a readable ONNX model: {e}")]
    out: list[Finding] = []
    opset = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if rules.opset is not None and opset != rules.opset:
        out.append(Finding(rel, "opset", f"default-domain opset {opset}, the target needs {rules.opset}"))
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for v in values:
            dims = _dims(v)
            if rules.static and any(not isinstance(d, int) or d <= 0 for d in dims):
                out.append(Finding(rel, "dynamic dimension", f"{kind} {v.name} has shape "
                                   f"[{', '.join(str(d) if d is not None else '?' for d in dims)}]"))
            dtype = _dtype_name(v.type.tensor_type.elem_type)
            if rules.io_dtypes and dtype not in rules.io_dtypes:
                out.append(Finding(rel, "dtype", f"{kind} {v.name} is {dtype}"))
    inline = 0
    bad_dtypes: dict[str, list[str]] = {}
    for t in model.graph.initializer:
        dtype = _dtype_name(t.data_type)
        if rules.initializer_dtypes and dtype not in rules.initializer_dtypes:
            bad_dtypes.setdefault(dtype, []).append(t.name)
        if t.data_location != onnx.TensorProto.EXTERNAL:
            inline += t.ByteSize()
    for dtype, names in bad_dtypes.items():
        out.append(Finding(rel, "dtype", f"{len(names)} initializer(s) in {dtype}, first {names[0]}"))
    if inline >= PROTOBUF_LIMIT or path.stat().st_size >= PROTOBUF_LIMIT:
        out.append(Finding(rel, "external data", f"{inline / 1e9:.2f} GB of initializers inside the protobuf file "
                                                 "(limit 2 GB): save them as external data"))
    if rules.ops is not None:
        used: dict[str, int] = {}
        for node in model.graph.node:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"
            used[key] = used.get(key, 0) + 1
        for key in sorted(set(used) - rules.ops):
            out.append(Finding(rel, "operator", f"{key} ({used[key]} node(s)) is outside the target's list"))
    return out


def lint(folder: str | Path, target: str = "ryzenai") -> LintResult:
    """Lint every .onnx file under `folder` against `target`'s rules."""
    if target not in TARGETS:
        raise UsageError(f"--target {target!r}: choose one of {', '.join(TARGETS)}.")
    folder = Path(folder)
    if not folder.exists():
        raise InputError(f"{folder}: no such file or folder to check.")
    files = [folder] if folder.is_file() else sorted(folder.rglob("*.onnx"))
    rules = TARGETS[target]
    result = LintResult(str(folder), target, [], rules=rules.source)
    for f in files:
        rel = f.name if folder.is_file() else str(f.relative_to(folder))
        result.files.append(rel)
        result.findings.extend(lint_file(f, rules, rel))
    if not files:
        result.findings.append(Finding(str(folder), "files", "no .onnx file found"))
    return result
