"""`port validate DIR/text_encoder --runtime onnxruntime`: the int4 MatMulNBits text encoder of a ryzenai export,
judged on prompt embeddings by the same ratio rule as the transformer.

- golden: the source Qwen3 text encoder in torch float32 (the folder the export manifest names);
- intrinsic: the same model in torch with every Linear weight replaced by its symmetric int4 block quantization
  (`porting.export.ryzenai.int4_dequantize_torch`, the block size the export used), float32 compute;
- device under test: onnxruntime on the exported graph;
- pass iff no NaN/Inf and the prompt embeddings' relative L2 error is at most `max_ratio` x the intrinsic error.

Localisation: every MatMulNBits weight of the graph is dequantized and compared, block by block, with the int4
quantization of its source weight computed in torch (which reproduces onnxruntime's quantizer exactly on the tiny
model: 0 difference); a block that differs by more than 1 % of its quantization step was not produced by quantizing
the source weight, and the report names the weight, the output row and the block.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from porting import __version__
from porting.errors import InputError, PortError
from porting.outputs import atomic_folder, check_output

from .metrics import compare, error_ratio
from .report import REPORT_JSON, REPORT_MD, Report, _finite

PROMPTS = ("a red fox in the snow", "a city street at night, neon signs reflected in puddles",
           "portrait of an old sailor, oil painting")
TOLERANCE_STEPS = 0.01  # an intact block equals the torch int4 quantization of its source block
WEIGHT_SUFFIX = ".T_Q4"


class TextEncoderReport(Report):
    def write(self, folder: Path, inputs: Any = None) -> list[Path]:
        with atomic_folder(folder, verb="validate", replace="owned", inputs=inputs) as staging:
            (staging / REPORT_JSON).write_text(json.dumps(_finite(self.data), indent=2) + "\n")
            (staging / REPORT_MD).write_text(to_markdown(self.data))
        return [folder / REPORT_JSON, folder / REPORT_MD]


def to_markdown(d: dict[str, Any]) -> str:
    lines = [f"# Text encoder validation: **{d['verdict'].upper()}**", "", f"- model: `{d['model']['path']}`",
             f"- device under test: `{d['device']}` ({d['ran']})",
             f"- golden: torch {d['golden_dtype']} on `{d['model']['source']}`; intrinsic: {d['intrinsic']}",
             f"- rule: {d['rule']['statement']}", ""]
    if d["reasons"]:
        lines += ["## Why it failed", ""] + [f"- {r}" for r in d["reasons"]] + [""]
    lines += ["## Prompt embeddings", "", "| prompt | device rel-L2 | intrinsic rel-L2 | ratio | cosine |",
              "|---|---|---|---|---|"]
    for row in d["summary"]:
        lines.append(f"| {row['name']} | {row['device_error']:.4%} | {row['intrinsic_error']:.4%} | "
                     f"{row['ratio']:.2f} | {row['cosine']:.6f} |")
    w = d["weights_check"]
    lines += ["", "## int4 weights against the source, block by block", "",
              f"{w['weights']} MatMulNBits weights, {w['blocks']} blocks of {w['block_size']}; "
              f"{len(w['bad_blocks'])} block(s) not explained by quantizing the source weight."]
    for b in w["bad_blocks"][:20]:
        lines.append(f"- `{b['weight']}` output row {b['row']}, block {b['block']} (input columns {b['columns']}): "
                     f"largest difference {b['steps']:.2f} quantization steps (0 when intact)")
    return "\n".join(lines) + "\n"


def _root(folder: Path) -> tuple[Path, dict[str, Any]]:
    from porting.export.identity import check
    from porting.export.onnx import find_manifest

    root, manifest = find_manifest(folder)
    if manifest.get("target") != "ryzenai" or "text_encoder" not in manifest.get("components", {}):
        raise PortError(f"{folder}: onnxruntime validation of a text encoder takes a --target ryzenai export's "
                        "text_encoder folder.", hint="Export with port export FOLDER --format onnx --target ryzenai.")
    check(root, manifest, own=False)  # the export's own graph is what validate judges
    return root, manifest


def dequantize_matmulnbits(b: np.ndarray, scales: np.ndarray, n: int, k: int, block: int) -> np.ndarray:
    """The (N, K) weight a symmetric 4-bit MatMulNBits holds (codes around 8, low nibble first)."""
    packed = b.reshape(n, -1, block // 2)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1, block).astype(np.float32)
    deq = (codes - 8.0) * scales.reshape(n, -1, 1).astype(np.float32)
    return deq.reshape(n, -1)[:, :k]


def check_weights(model_file: Path, source: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Dequantize every MatMulNBits weight and compare it with its source weight's int4 blocks, block by block."""
    import onnx
    from onnx import numpy_helper

    from porting.export.ryzenai import int4_dequantize_torch

    model = onnx.load(str(model_file))  # with its external data
    inits = {t.name: t for t in model.graph.initializer}
    bad, blocks, weights, block_size, unmatched = [], 0, 0, None, []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        n, k, block_size = attrs["N"], attrs["K"], attrs["block_size"]
        name = node.input[1]
        src_name = name[: -len(WEIGHT_SUFFIX)] if name.endswith(WEIGHT_SUFFIX) else None
        src_key = src_name.split(".", 1)[1] if src_name and src_name.split(".", 1)[1] in source else src_name
        if src_key not in source:
            unmatched.append(name)
            continue
        weights += 1
        scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, -1)
        deq = dequantize_matmulnbits(numpy_helper.to_array(inits[name]), scales, n, k, block_size)
        want = int4_dequantize_torch(source[src_key].to(torch.float32), block_size).numpy()  # (out=N, in=K)
        pad = (-k) % block_size
        diff = np.abs(np.pad(deq - want, ((0, 0), (0, pad)))).reshape(n, -1, block_size).max(axis=-1)
        step = np.abs(scales)
        steps = np.where(step > 0, diff / np.where(step > 0, step, 1), np.where(diff > 0, np.inf, 0))
        blocks += steps.size
        for row, blk in zip(*np.nonzero(steps > TOLERANCE_STEPS)):
            bad.append({"weight": src_key, "initializer": name, "row": int(row), "block": int(blk),
                        "columns": f"{blk * block_size}..{min(k, (blk + 1) * block_size) - 1}",
                        "steps": float(steps[row, blk])})
    return {"weights": weights, "blocks": blocks, "block_size": block_size, "bad_blocks": bad,
            "unmatched": unmatched}


def validate_text_encoder(folder: Path, *, out: Path | None = None, max_ratio: float = 2.0,
                          provider: str = "CPUExecutionProvider", prompt: str | None = None,
                          settings: Any = None) -> Report:
    from porting.export.ort import open_session

    root, manifest = _root(folder)
    src = (manifest.get("source") or {}).get("text_encoder")
    tok_dir = (manifest.get("source") or {}).get("tokenizer")
    if not src or not Path(src).is_dir():
        raise InputError(f"{root}: the source text encoder {src} the export names is not there; the golden runs on "
                         "it.", hint="Keep the source folder where it was exported from, or export again.")
    read_paths = {"model": folder, "source text encoder": src, "tokenizer": tok_dir}
    if out is not None:
        check_output(Path(out), verb="validate", replace="owned", inputs=read_paths)
    comp = manifest["components"]["text_encoder"]
    _require_memory(folder, int(comp.get("params") or 0))
    text_len, block = manifest["profile"]["text_len"], comp["block_size"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir or (root / "tokenizer"), local_files_only=True)
    prompts = [prompt] if prompt else list(PROMPTS)
    enc = tokenizer(prompts, padding="max_length", max_length=text_len, truncation=True, return_tensors="pt")
    golden, intrinsic, source = _torch_runs(Path(src), enc, len(prompts), block)
    session = open_session(folder, provider, settings=settings)
    names = [i.name for i in session.get_inputs()]
    device = torch.cat([torch.from_numpy(session.run(None, {
        names[0]: enc.input_ids[i:i + 1].numpy().astype(np.int64),
        names[1]: enc.attention_mask[i:i + 1].numpy().astype(np.int64)})[0]) for i in range(len(prompts))])
    model_file = folder / Path(comp["file"]).name
    weights = check_weights(model_file, source)

    overall_dev, overall_int, ratio, summary = _errors(device, golden, intrinsic, prompts)
    reasons = _reasons(overall_dev, overall_int, ratio, max_ratio, weights)
    ort_facts = {"runtime": "onnxruntime", "provider": provider, "session_providers": session.get_providers()}
    data = {
        "tool": "flux-port", "version": __version__, "format_version": 1, "kind": "text-encoder-validation",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {"path": str(folder.resolve()), "source": src, "file": str(model_file)},
        "weights_sha256": manifest["source"].get("weights_sha256"),
        "device": f"onnxruntime:{provider}", "dtype": "int4", "reference": "cpu", "golden_dtype": "fp32",
        "ran": (f"int4 MatMulNBits weights (block {block}, symmetric, accuracy_level "
                f"{comp.get('accuracy_level')}), embedding and norms float32, onnxruntime's CPU kernels"),
        "intrinsic": f"torch float32 with every Linear weight int4-block-quantized (block {block}, symmetric)",
        "runtime": "onnxruntime", "environment": {"device": ort_facts},
        "inputs": {"prompts": prompts, "text_len": text_len, "padding": "max_length"},
        "rule": {"metric": "relative L2 error of the prompt embeddings against the golden", "max_ratio": max_ratio,
                 "statement": f"pass iff no NaN/Inf, the prompt embeddings' error is at most {max_ratio}x the "
                              "intrinsic int4 error, and every int4 block is the quantization of its source block"},
        "output": {"device": overall_dev, "intrinsic": overall_int, "ratio": ratio},
        "summary": summary, "blocks": [], "blame": weights["bad_blocks"][0] if weights["bad_blocks"] else None,
        "localisation": {"per_block": False, "note": "int4 weights are checked block by block against the source "
                                                     "weights (weights_check); activations are judged whole"},
        "weights_check": weights, "export": {"folder": str(root.resolve()), "target": "ryzenai"},
        "verdict": "fail" if reasons else "pass", "reasons": reasons,
    }
    report = TextEncoderReport(data)
    if out is not None:
        report.write(Path(out), inputs=read_paths)
    return report


def _require_memory(folder: Path, params: int) -> None:
    """Room for the float32 model and the source copy the block check reads."""
    from porting.resources import MEMORY_OVERHEAD, gib, require_memory

    weights_bytes = 4 * params
    require_memory(f"{folder}: validating a {params / 1e9:.2f} B-parameter text encoder",
                   2 * weights_bytes + MEMORY_OVERHEAD,
                   f"{gib(weights_bytes)} of float32 weights x 2 + {gib(MEMORY_OVERHEAD)}",
                   hint="Run it on a machine with more memory.")


def _torch_runs(src: Path, enc: Any, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The golden (float32) and intrinsic (the same int4 blocks, applied in torch) prompt embeddings, and the source
    encoder's float32 weights the block check compares against."""
    from porting.export.ryzenai import int4_dequantize_torch
    from porting.families.flux2_export import load_text_encoder

    traced = load_text_encoder(src, torch.float32)
    module = traced.module
    source = {k: v.detach().clone() for k, v in module.encoder.state_dict().items()}
    with torch.no_grad():
        golden = torch.cat([module(input_ids=enc.input_ids[i:i + 1], attention_mask=enc.attention_mask[i:i + 1])
                            for i in range(n)])
        for mod in module.encoder.modules():  # the intrinsic run: the same int4 blocks, applied in torch
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(int4_dequantize_torch(mod.weight, block))
        intrinsic = torch.cat([module(input_ids=enc.input_ids[i:i + 1],
                                      attention_mask=enc.attention_mask[i:i + 1]) for i in range(n)])
    return golden, intrinsic, source


def _errors(device: torch.Tensor, golden: torch.Tensor, intrinsic: torch.Tensor,
            prompts: list[str]) -> tuple[dict[str, Any], dict[str, Any], float, list[dict[str, Any]]]:
    """The device's and the intrinsic run's error against the golden, their ratio, and the summary rows (all
    prompts, then each)."""
    f32 = torch.float32
    overall_dev, overall_int = compare(device, golden, f32), compare(intrinsic, golden, f32)
    ratio = error_ratio(overall_dev["rel_l2"], overall_int["rel_l2"], f32)
    summary = [{"name": "all prompts", "device_error": overall_dev["rel_l2"],
                "intrinsic_error": overall_int["rel_l2"], "ratio": ratio, "cosine": overall_dev["cosine"]}]
    for i, p in enumerate(prompts):
        d, r = compare(device[i], golden[i], f32), compare(intrinsic[i], golden[i], f32)
        summary.append({"name": p, "device_error": d["rel_l2"], "intrinsic_error": r["rel_l2"],
                        "ratio": error_ratio(d["rel_l2"], r["rel_l2"], f32), "cosine": d["cosine"]})
    return overall_dev, overall_int, ratio, summary


def _reasons(overall_dev: dict[str, Any], overall_int: dict[str, Any], ratio: float, max_ratio: float,
             weights: dict[str, Any]) -> list[str]:
    """Why the export fails (empty: it passes): NaN/Inf, the error ratio, int4 blocks unlike the source's."""
    reasons = []
    if overall_dev["nonfinite"]:
        reasons.append(f"NaN/Inf in the prompt embeddings ({overall_dev['nonfinite']} element(s))")
    if ratio > max_ratio:
        reasons.append(f"prompt embeddings error {overall_dev['rel_l2']:.3%} is {ratio:.2f}x the intrinsic int4 "
                       f"error {overall_int['rel_l2']:.3%} (limit {max_ratio}x)")
    if weights["bad_blocks"]:
        b = weights["bad_blocks"][0]
        reasons.append(f"{len(weights['bad_blocks'])} int4 block(s) differ from the int4 quantization of the source "
                       f"weight; first: {b['weight']} row {b['row']} block {b['block']} (columns "
                       f"{b['columns']}, {b['steps']:.2f} steps)")
    if weights["unmatched"]:
        reasons.append(f"{len(weights['unmatched'])} MatMulNBits weight(s) match no source weight, first "
                       f"{weights['unmatched'][0]}")
    return reasons
