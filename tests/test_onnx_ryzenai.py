"""port export --format onnx --target ryzenai, port export --check, and onnxruntime validation of what the NPU
would run, on the tiny klein.

Fast tests (graph passes, lint, int4 arithmetic, option refusals) run on small hand-made graphs. The tests on a real
export share one module fixture (a tiny klein with a 3-layer text encoder and float32 transformer weights that bf16
rounds, so the bf16 intrinsic error is not zero); the whole file took 50 s on 2 cores, the export most of it, so
those are marked slow.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import build_tiny_port  # noqa: E402

from porting.cli.app import main  # noqa: E402
from porting.errors import UsageError  # noqa: E402
from porting.export import ryzenai  # noqa: E402
from porting.export.lint import lint  # noqa: E402
from porting.export.onnx import MANIFEST, export_onnx  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from validation.api import validate  # noqa: E402
from validation.text_encoder import dequantize_matmulnbits  # noqa: E402

PROFILE = ryzenai.Profile(size=32, text_len=8, block_size=16)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


def _opset(model) -> int:
    return next(int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx"))


# ---------------------------------------------------------------- fast: graph passes, lint, int4, options

def _opset18_graph(dynamic: bool):
    """x -> ReduceMean(axes input) -> Split(num_outputs=2) -> Add: the opset-18 signatures the downgrade rewrites."""
    from onnx import TensorProto, helper, numpy_helper

    batch = "batch" if dynamic else 1
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1, name="mean"),
             helper.make_node("Sub", ["x", "m"], ["c"], name="sub"),
             helper.make_node("Split", ["c"], ["a", "b"], axis=1, num_outputs=2, name="split"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
                              [numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_downgrade_rewrites_opset_18_signatures_and_keeps_the_numbers(tmp_path) -> None:
    import onnx
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    model18 = _opset18_graph(dynamic=False)
    want = ort.InferenceSession(model18.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    model17 = ryzenai.downgrade_to_17(_opset18_graph(dynamic=False))
    onnx.checker.check_model(model17, full_check=True)  # against opset 17's schemas
    assert _opset(model17) == 17
    ops = {n.op_type: n for n in model17.graph.node}
    assert [a.ints for a in ops["ReduceMean"].attribute if a.name == "axes"] == [[1]]
    assert len(ops["Split"].input) == 2 and not any(a.name == "num_outputs" for a in ops["Split"].attribute)
    assert "axes" not in {t.name for t in model17.graph.initializer}
    got = ort.InferenceSession(model17.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(got[0], want[0])


def test_lint_flags_opset_dynamic_dims_and_foreign_ops(tmp_path) -> None:
    import onnx

    (tmp_path / "m").mkdir()
    onnx.save(_opset18_graph(dynamic=True), str(tmp_path / "m" / "model.onnx"))
    result = lint(tmp_path, "ryzenai")
    checks = {f.check for f in result.findings}
    assert not result.ok and {"opset", "dynamic dimension"} <= checks
    assert any("input x" in f.detail and "batch" in f.detail for f in result.findings)
    assert lint(tmp_path, "generic").ok  # the generic target has no such constraint
    model = ryzenai.downgrade_to_17(_opset18_graph(dynamic=False))
    model.graph.node.append(onnx.helper.make_node("Einsum", ["y", "y"], ["z"], equation="ij,ij->ij"))
    onnx.save(model, str(tmp_path / "m" / "model.onnx"))
    found = lint(tmp_path, "ryzenai").findings
    assert [f.check for f in found] == ["operator"] and "Einsum" in found[0].detail


def test_check_cli_table_json_and_exit_codes(tmp_path, capsys) -> None:
    import onnx

    (tmp_path / "m").mkdir()
    onnx.save(_opset18_graph(dynamic=True), str(tmp_path / "m" / "model.onnx"))
    code, out, _ = run_cli(["export", "--check", str(tmp_path), "--target", "ryzenai", "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and {f["check"] for f in doc["findings"]} >= {"opset"}
    code, out, _ = run_cli(["export", "--check", str(tmp_path), "--target", "generic"], capsys)
    assert code == 0 and "PASS" in out


def test_int4_in_torch_equals_onnxruntimes_quantizer() -> None:
    """The intrinsic int4 error of validate is computed with exactly the quantizer's arithmetic."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(1).standard_normal((40, 24)).astype(np.float32)  # (K=40, N=24): K not a block multiple
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 40])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24])],
                              [numpy_helper.from_array(w, "w")])
    model = ryzenai.int4_matmulnbits(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                     ryzenai.Profile(block_size=16))
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    deq = dequantize_matmulnbits(inits[node.input[1]], inits[node.input[2]], 24, 40, 16)
    mine = ryzenai.int4_dequantize_torch(torch.from_numpy(w.T.copy()), 16).numpy()
    assert np.abs(deq - mine).max() == 0 and np.abs(deq - w.T).max() > 0
    assert onnx.checker.check_model(model) is None


@pytest.mark.parametrize("argv, named", [
    (["--target", "ryzenai", "--block-size", "24"], "--block-size 24"),
    (["--target", "ryzenai", "--block-size", "8"], "--block-size 8"),
    (["--target", "ryzenai", "--size", "1000"], "--size 1000"),
    (["--target", "ryzenai", "--opset", "18"], "--opset 18"),
    (["--target", "ryzenai", "--accuracy-level", "7"], "--accuracy-level 7"),
    (["--target", "ryzenai", "--dtype", "fp16"], "--dtype fp16"),
    (["--size", "512"], "--size"),
    (["--opset", "17"], "--opset 17"),  # the generic exporter writes 18 at the least
])
def test_options_are_refused_by_name_before_any_work(tmp_path, capsys, argv, named) -> None:
    src = tmp_path / "src"
    src.mkdir()
    code, _, err = run_cli(["export", str(src), "--out", str(tmp_path / "out"), *argv], capsys)
    assert code == 2 and named in err and not (tmp_path / "out").exists()


def test_profile_defaults() -> None:
    p = ryzenai.check_profile(ryzenai.DEFAULT_SIZE, ryzenai.DEFAULT_TEXT_LEN, ryzenai.DEFAULT_BLOCK_SIZE, None)
    assert (p.size, p.text_len, p.block_size) == (1024, 512, 128)
    with pytest.raises(UsageError, match="power of two"):
        ryzenai.check_profile(1024, 512, 96, None)


# ---------------------------------------------------------------- slow: one real export of the tiny klein

def _trim_text_encoder(folder: Path, layers: int) -> None:
    from safetensors.torch import load_file, save_file

    cfg_path = folder / "text_encoder" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = cfg.get("layer_types", [])[:layers] or None
    cfg_path.unlink()  # a hard link into the shared tiny port, like the weights below
    cfg_path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=2))
    for f in (folder / "text_encoder").glob("*.safetensors"):
        tensors = load_file(f)
        keep = {k: v for k, v in tensors.items()
                if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)}
        f.unlink()  # publish hard-links the tiny port's files: never write through into the shared port
        save_file(keep, f, metadata={"format": "pt"})


def _fp32_transformer(folder: Path) -> None:
    """Weights in float32 that bf16 does not represent (the tiny port stores bf16, whose rounding is exact)."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(5)
    for f in (folder / "transformer").glob("*.safetensors"):
        tensors = load_file(f)
        out = {k: (v.float() + 1e-3 * v.float().std() * torch.randn(v.shape, generator=gen)
                   if v.is_floating_point() else v) for k, v in tensors.items()}
        f.unlink()  # a hard link into the shared tiny port (tests/test_onnx.py uses it after this file)
        save_file(out, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ryzen_export(tmp_path_factory) -> tuple[Path, Path, dict]:
    port = build_tiny_port(tmp_path_factory.getbasetemp() / "tiny-port")
    folder = tmp_path_factory.mktemp("rz-src") / "klein"
    publish(port["base"], port["transformer"], folder, report=port["pass"])
    _trim_text_encoder(folder, 3)
    _fp32_transformer(folder)
    out = tmp_path_factory.mktemp("rz") / "klein-ryzenai"
    export_onnx(folder, out, target="ryzenai", profile=PROFILE)
    return folder, out, json.loads((out / MANIFEST).read_text())


@pytest.mark.slow
def test_ryzenai_layout_opset_17_and_static_shapes(ryzen_export) -> None:
    import onnx

    _, out, manifest = ryzen_export
    assert {p.name for p in out.iterdir()} >= {"scheduler", "text_encoder", "tokenizer", "transformer",
                                               "vae_decoder", MANIFEST}
    assert (out / "text_encoder" / ryzenai.TEXT_ENCODER_FILE).is_file()
    assert (out / "transformer" / "config.json").is_file() and (out / "tokenizer").is_dir()
    assert manifest["target"] == "ryzenai" and manifest["profile"]["size"] == 32
    graphs = sorted(out.rglob("*.onnx"))
    assert len(graphs) == 3
    for g in graphs:
        model = onnx.load(str(g), load_external_data=False)
        assert _opset(model) == 17, g
        for v in list(model.graph.input) + list(model.graph.output):
            dims = v.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") and d.dim_value > 0 for d in dims), (g, v.name)
            assert dims[0].dim_value == 1  # batch 1
        onnx.checker.check_model(str(g))
    transformer = onnx.load(str(out / "transformer" / "model.onnx"), load_external_data=False)
    dtypes = {t.name: t.data_type for t in transformer.graph.initializer}
    name = "model.transformer_blocks.0.ff.linear_in.weight"  # streamed from the safetensors file as it is named
    name = name if name in dtypes else name + ".T"  # a weight under 1024 values may have its transpose folded
    assert dtypes[name] == onnx.TensorProto.BFLOAT16
    assert any(n.op_type == "Cast" and n.input[0] == name for n in transformer.graph.node)
    floats = [k for k, v in dtypes.items() if v == onnx.TensorProto.FLOAT and k.startswith("model.")]
    assert not [k for k in floats if k.endswith(".weight") and "norm" not in k]  # every weight >= 16 values: bf16
    assert manifest["components"]["transformer"]["streamed"] is True  # hollow trace, weights streamed to .data
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in transformer.graph.input}
    assert shapes["hidden_states"] == [1, 4, 16] and shapes["encoder_hidden_states"] == [1, 8, 48]


@pytest.mark.slow
def test_text_encoder_is_int4_matmulnbits_with_float_embedding_and_norms(ryzen_export) -> None:
    import onnx

    _, out, manifest = ryzen_export
    model = onnx.load(str(out / "text_encoder" / ryzenai.TEXT_ENCODER_FILE), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 3 * 7  # q, k, v, o, gate, up, down per layer
    inits = {t.name: t for t in model.graph.initializer}
    embedding = next(n.input[0] for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    assert inits[embedding].data_type == onnx.TensorProto.FLOAT  # tied: named encoder.lm_head.weight
    assert inits["encoder.model.layers.0.input_layernorm.weight"].data_type == onnx.TensorProto.FLOAT
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 16 and len(node.input) == 3  # symmetric: no zero points
    assert manifest["components"]["text_encoder"]["matmulnbits"] == 21


@pytest.mark.slow
def test_lint_passes_the_ryzenai_export_and_flags_a_generic_one(ryzen_export, tmp_path, capsys) -> None:
    folder, out, _ = ryzen_export
    assert lint(out, "ryzenai").ok
    generic = tmp_path / "generic"
    export_onnx(folder, generic, components=["vae_decoder"])  # dynamic axes, opset 18
    code, stdout, _ = run_cli(["export", "--check", str(generic), "--target", "ryzenai", "--json"], capsys)
    doc = json.loads(stdout)
    checks = {f["check"] for f in doc["findings"]}
    assert code == 1 and {"opset", "dynamic dimension"} <= checks


@pytest.mark.slow
def test_transformer_validates_on_onnxruntime_cpu_against_bf16_rounding(ryzen_export, tmp_path) -> None:
    _, out, _ = ryzen_export
    d = validate(out / "transformer", runtime="onnxruntime", out=tmp_path / "rep").to_dict()
    assert d["verdict"] == "pass", d["reasons"]
    assert d["golden_dtype"] == "fp32" and d["dtype"] == "bf16"
    assert d["output"]["intrinsic"]["rel_l2"] > 0 and d["output"]["ratio"] <= 2
    assert d["inputs"]["resolution"] == 32 and d["inputs"]["text_tokens"] == 8  # the export's static shape
    assert "cast to float32" in d["export"]["ran"]
    assert "what onnxruntime ran" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.slow
def test_text_encoder_prompt_embeddings_within_the_ratio_rule(ryzen_export, tmp_path) -> None:
    _, out, _ = ryzen_export
    d = validate(out / "text_encoder", runtime="onnxruntime", out=tmp_path / "te").to_dict()
    assert d["verdict"] == "pass", d["reasons"]
    assert d["output"]["intrinsic"]["rel_l2"] > 1e-3 and d["output"]["ratio"] <= 2
    assert d["weights_check"]["weights"] == 21 and d["weights_check"]["bad_blocks"] == []
    assert len(d["summary"]) == 1 + 3 and "int4 MatMulNBits" in d["ran"]


@pytest.mark.slow
def test_a_perturbed_int4_block_fails_and_is_located(ryzen_export, tmp_path) -> None:
    import onnx

    _, out, _ = ryzen_export
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    te = broken / "text_encoder"
    model = onnx.load(str(te / ryzenai.TEXT_ENCODER_FILE), load_external_data=False)
    target = "encoder.model.layers.1.mlp.down_proj.weight.T_Q4"
    init = next(t for t in model.graph.initializer if t.name == target)
    where = {e.key: e.value for e in init.external_data} if init.data_location == onnx.TensorProto.EXTERNAL else None
    n, blocks, blob = init.dims
    row, block = 5, 1
    if where is None:  # small enough to sit inside the graph: edit it there
        raw = bytearray(init.raw_data)
        start = (row * blocks + block) * blob
        raw[start:start + blob] = bytes(b ^ 0x77 for b in raw[start:start + blob])
        init.raw_data = bytes(raw)
        onnx.save(model, str(te / ryzenai.TEXT_ENCODER_FILE), save_as_external_data=True,
                  all_tensors_to_one_file=True, location=ryzenai.TEXT_ENCODER_FILE + ".data", size_threshold=1024)
    else:
        with open(te / where["location"], "r+b") as f:
            start = int(where.get("offset", 0)) + (row * blocks + block) * blob
            f.seek(start)
            chunk = f.read(blob)
            f.seek(start)
            f.write(bytes(b ^ 0x77 for b in chunk))
    d = validate(te, runtime="onnxruntime").to_dict()
    assert d["verdict"] == "fail"
    bad = d["weights_check"]["bad_blocks"]
    assert bad and all(b["weight"] == "model.layers.1.mlp.down_proj.weight" for b in bad)
    assert {(b["row"], b["block"]) for b in bad} == {(row, block)}
    assert any("model.layers.1.mlp.down_proj.weight row 5 block 1" in r for r in d["reasons"])


# ---------------------------------------------------------------- slow: bounded memory of the streamed export

MEMORY_CHILD = r"""
import json, resource, sys
from pathlib import Path
import diffusers, onnx, onnx_ir, onnxscript, torch  # noqa: F401  (the baseline: the interpreter with its imports)
from porting.export import ryzenai
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
proto, facts = ryzenai.stream_bf16_component("transformer", src, ryzenai.Profile(size=64, text_len=32), dest)
ryzenai.save_streamed(proto, dest, "model.onnx")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak}))
"""


@pytest.mark.slow
def test_streamed_export_memory_is_one_block_and_every_weight_is_external_data(tmp_path) -> None:
    """A synthetic transformer whose float32 weights (~1.1 GB) are many times its largest block's: the export's peak
    RSS over the interpreter's stays within 2 float32 copies of the largest block plus a graph allowance, and every
    initializer over 1 KB (every weight) is external data in model.onnx.data."""
    import math
    import subprocess

    import onnx

    from porting.demo.tiny import REAL_FLUX2, write_random_checkpoint
    from porting.tensors.checkpoint import read_header

    cfg = {**REAL_FLUX2["klein-4b"], "num_layers": 2, "num_single_layers": 16, "num_attention_heads": 8,
           "joint_attention_dim": 1024}  # hidden 1024
    src = tmp_path / "transformer"
    write_random_checkpoint(src / "diffusion_pytorch_model.safetensors", cfg, "diffusers", "BF16", seed=0,
                            fill="tiled")
    (src / "config.json").write_text(json.dumps(cfg))
    tensors, _ = read_header(src / "diffusion_pytorch_model.safetensors")
    blocks: dict[str, int] = {}
    for key, info in tensors.items():
        parts = key.split(".")
        block = ".".join(parts[:2]) if parts[0].endswith("transformer_blocks") else "other"
        blocks[block] = blocks.get(block, 0) + 4 * math.prod(info.shape)
    total, block = sum(blocks.values()), max(blocks.values())
    assert total > 8 * block  # the bound below would not tell a streamed export from a loaded one otherwise
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(src), str(tmp_path / "onnx")], check=True,
                         cwd=Path(__file__).parents[1],
                         capture_output=True, text=True, env={**__import__("os").environ,
                                                              "PYTHONPATH": str(Path(__file__).parents[1])})
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    graph_allowance = 256 * 2**20  # torch.export, onnx_ir and the proto of 18 blocks' nodes, no weights
    assert rss["peak"] - rss["base"] <= 2 * block + graph_allowance, (rss, block, total)
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    inline = [(t.name, len(t.raw_data)) for t in model.graph.initializer
              if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > 1024]
    assert not inline
    weights = [t for t in model.graph.initializer if t.name.startswith("model.")]
    assert len(weights) == len(tensors)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights if math.prod(t.dims) >= 16)
    data = (tmp_path / "onnx" / "model.onnx.data").stat().st_size
    assert data >= sum(2 * math.prod(i.shape) for i in tensors.values())  # bf16, tensor by tensor


def test_streamed_export_estimate_is_the_largest_tensor_not_the_model(tmp_path) -> None:
    from safetensors.torch import save_file

    from porting.resources import (
        MEMORY_OVERHEAD,
        STREAMED_GRAPH_BYTES,
        ResourceError,
        check_streamed_export_memory,
        streamed_export_bytes,
    )

    save_file({"a.weight": torch.zeros(64, 32, dtype=torch.bfloat16), "b.weight": torch.zeros(8, dtype=torch.bfloat16)},
              tmp_path / "diffusion_pytorch_model.safetensors")
    need, breakdown = streamed_export_bytes(tmp_path)
    assert need == MEMORY_OVERHEAD + STREAMED_GRAPH_BYTES + 2 * 64 * 32 * 4 and "a.weight" in breakdown
    with pytest.raises(ResourceError, match="streamed export"):
        check_streamed_export_memory("transformer", tmp_path, available=need - 1)
    assert check_streamed_export_memory("transformer", tmp_path, available=need) == need
