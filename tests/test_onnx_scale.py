"""The ryzenai export at real size, on the tiny klein: several `--size` values sharing one weights file.

The fast tests pin the option handling (several sizes reach the profile, a repeated size is refused, the graph
names); the slow ones export the tiny klein's transformer and VAE decoder at two sizes and run each graph.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import build_tiny_port  # noqa: E402

from porting.cli.app import main  # noqa: E402
from porting.errors import UsageError  # noqa: E402
from porting.export import ryzenai  # noqa: E402
from porting.export.lint import lint  # noqa: E402
from porting.export.onnx import MANIFEST, export_onnx  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from validation.api import validate  # noqa: E402

SIZES = (32, 48)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


# ---------------------------------------------------------------- fast: options and names

def test_several_sizes_reach_the_profile_in_order(tmp_path, capsys, monkeypatch) -> None:
    """`--size 64 --size 128` used to keep the last size only; now both reach the export, in the order given."""
    import porting.export.onnx as onnx_mod

    seen = {}

    def fake_export(folder, out, **kw):
        seen.update(kw)
        raise UsageError("stopped here")

    monkeypatch.setattr(onnx_mod, "export_onnx", fake_export)
    src = tmp_path / "src"
    src.mkdir()
    code, _, err = run_cli(["export", str(src), "--out", str(tmp_path / "out"), "--target", "ryzenai",
                            "--size", "64", "--size", "128"], capsys)
    assert code == 2 and "stopped here" in err
    assert seen["profile"].sizes == (64, 128) and seen["profile"].size == 64


@pytest.mark.parametrize("sizes, named", [
    ([64, 64], "--size 64 is given twice"),
    ([64, 1000], "--size 1000"),
    ([], "--size"),
])
def test_bad_size_lists_are_refused_by_name(sizes, named) -> None:
    with pytest.raises(UsageError, match=named):
        ryzenai.check_profile(sizes, 8, 16, None)


def test_graph_files_one_per_size_only_when_several() -> None:
    one = ryzenai.check_profile(512, 8, 16, None)
    two = ryzenai.check_profile([512, 768], 8, 16, None)
    assert ryzenai.graph_file("transformer", 512, one) == "model.onnx"  # the one-size layout is unchanged
    assert ryzenai.graph_file("transformer", 768, two) == "model_768.onnx"
    assert ryzenai.graph_file("vae_decoder", 512, two) == "model_512.onnx"
    assert ryzenai.graph_file("text_encoder", 512, two) == ryzenai.TEXT_ENCODER_FILE  # no image size in its shapes


# ---------------------------------------------------------------- slow: two sizes of the tiny klein

@pytest.fixture(scope="module")
def sized_export(tmp_path_factory) -> tuple[Path, Path, dict]:
    port = build_tiny_port(tmp_path_factory.getbasetemp() / "tiny-port")
    folder = tmp_path_factory.mktemp("rzs-src") / "klein"
    publish(port["base"], port["transformer"], folder, report=port["pass"])
    out = tmp_path_factory.mktemp("rzs") / "klein-ryzenai"
    profile = ryzenai.check_profile(list(SIZES), 8, 16, None)
    export_onnx(folder, out, target="ryzenai", profile=profile, components=["transformer", "vae_decoder"])
    return folder, out, json.loads((out / MANIFEST).read_text())


def _external(path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (location, offset, length) of every external initializer of a graph."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in t.external_data}
            out[t.name] = (where["location"], int(where.get("offset", 0)), int(where["length"]))
    return out


@pytest.mark.slow
def test_two_sizes_share_one_weights_file_written_once(sized_export) -> None:
    _, out, manifest = sized_export
    for c in ("transformer", "vae_decoder"):
        files = sorted(p.name for p in (out / c).iterdir())
        assert files == ["config.json", "model.onnx.data", "model_32.onnx", "model_48.onnx"], files
        a, b = _external(out / c / "model_32.onnx"), _external(out / c / "model_48.onnx")
        weights = [n for n in a if n.startswith(("model.", "vae."))]
        assert weights and len(weights) == len([n for n in b if n.startswith(("model.", "vae."))])
        # by name and by bytes: each weight of the second graph is the first graph's, same file, offset and length
        assert {n: a[n] for n in weights} == {n: b[n] for n in weights}
        assert {loc for loc, _, _ in list(a.values()) + list(b.values())} == {"model.onnx.data"}
        # written once: the file holds one copy of the weights (plus the few folded constants of each size)
        weight_bytes = sum(length for _, _, length in (a[n] for n in weights))
        assert (out / c / "model.onnx.data").stat().st_size < 1.5 * weight_bytes
        graphs = manifest["components"][c]["graphs"]
        assert set(graphs) == {"32", "48"} and manifest["components"][c]["data_file"] == "model.onnx.data"
    assert manifest["profile"]["sizes"] == list(SIZES) and manifest["profile"]["size"] == SIZES[0]
    shapes = manifest["components"]["transformer"]["graphs"]
    assert shapes["32"]["input_shapes"]["hidden_states"] == [1, 4, 16]
    assert shapes["48"]["input_shapes"]["hidden_states"] == [1, 9, 16]
    assert manifest["components"]["vae_decoder"]["graphs"]["48"]["input_shapes"]["latent_sample"][2:] == [6, 6]


@pytest.mark.slow
def test_check_reads_every_graph_and_passes(sized_export, capsys) -> None:
    _, out, manifest = sized_export
    result = lint(out, "ryzenai")
    assert result.ok and {"transformer/model_32.onnx", "transformer/model_48.onnx", "vae_decoder/model_32.onnx",
                          "vae_decoder/model_48.onnx"} <= set(result.files)
    assert manifest["check"]["ok"] is True and len(manifest["check"]["files"]) == 4
    code, stdout, _ = run_cli(["export", "--check", str(out), "--target", "ryzenai", "--json"], capsys)
    assert code == 0 and len(json.loads(stdout)["files"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_each_size_runs_on_onnxruntime_and_matches_torch(sized_export, tmp_path, size) -> None:
    _, out, _ = sized_export
    d = validate(out / "transformer", runtime="onnxruntime", resolution=size, out=tmp_path / "rep").to_dict()
    assert d["verdict"] == "pass", d["reasons"]
    assert d["inputs"]["resolution"] == size and d["output"]["ratio"] <= 2
    assert Path(d["environment"]["device"]["model"]).name == f"model_{size}.onnx"


@pytest.mark.slow
def test_a_folder_of_several_graphs_without_a_size_is_refused_by_name(sized_export) -> None:
    from porting.errors import InputError
    from porting.export.ort import open_session

    _, out, _ = sized_export
    with pytest.raises(InputError, match="model_32.onnx, model_48.onnx"):
        open_session(out / "transformer")


# ---------------------------------------------------------------- the text encoder, streamed and quantized as read

def _trimmed_encoder(src: Path, dest: Path, layers: int, rename: dict[str, str] | None = None,
                     extra: dict | None = None, config: dict | None = None) -> Path:
    """A copy of a Qwen3 folder cut to `layers` layers; keys renamed, tensors added or config fields changed."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, layer_types=cfg.get("layer_types", [])[:layers], **(config or {}))
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update({k: v for k, v in load_file(f).items()
                        if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)})
    tensors = {(rename or {}).get(k, k): v for k, v in tensors.items()}
    save_file({**tensors, **(extra or {})}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def tiny_qwen3(sized_export, tmp_path_factory) -> Path:
    folder, _, _ = sized_export
    return _trimmed_encoder(folder / "text_encoder", tmp_path_factory.mktemp("qwen3") / "te", 3)


def _inits(path: Path) -> dict:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    return {t.name: numpy_helper.to_array(t, base_dir=str(path.parent)) for t in model.graph.initializer}


def _run(path: Path, ids, mask):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids, "attention_mask": mask})[0]


@pytest.mark.slow
def test_streamed_text_encoder_equals_the_in_memory_export(tiny_qwen3, tmp_path) -> None:
    """The streamed export (hollow trace, each Linear quantized by onnxruntime's block quantizer as it is read) holds
    the same int4 blocks and scales as onnxruntime's MatMulNBitsQuantizer applied to the in-memory float32 graph,
    bit for bit, the same float32 embedding and norms, and computes the same prompt embeddings."""
    import numpy as np
    import onnx
    import torch

    from porting.export.streamed_text import stream_int4_text_encoder
    from porting.families.flux2_export import load_text_encoder

    profile = ryzenai.Profile(size=32, text_len=8, block_size=16)
    proto, facts = stream_int4_text_encoder(tiny_qwen3, profile, tmp_path / "s")
    ryzenai.save_streamed(proto, tmp_path / "s", facts["file"], facts["data_file"])
    mem, mem_facts = ryzenai.finish_component("text_encoder", load_text_encoder(tiny_qwen3, torch.float32), profile)
    ryzenai.save(mem, tmp_path / "m", mem_facts["file"])
    s_path, m_path = tmp_path / "s" / facts["file"], tmp_path / "m" / facts["file"]
    s, m = _inits(s_path), _inits(m_path)
    quantized = sorted(k for k in m if k.endswith((".T_Q4", ".T_scales")))
    assert len(quantized) == 2 * 21 and facts["matmulnbits"] == mem_facts["matmulnbits"] == 21
    for k in quantized:
        assert s[k].dtype == m[k].dtype and s[k].shape == m[k].shape and np.array_equal(s[k], m[k]), k
    # the tied embedding: the in-memory trace names it after lm_head, the streamed one reads model.embed_tokens
    assert np.array_equal(s["encoder.model.embed_tokens.weight"], m["encoder.lm_head.weight"])
    for k in (k for k in m if "norm" in k):
        assert np.array_equal(s[k], m[k]), k

    def attrs(path):
        model = onnx.load(str(path), load_external_data=False)
        return sorted((n.input[1], tuple(sorted((a.name, a.i) for a in n.attribute)))
                      for n in model.graph.node if n.op_type == "MatMulNBits")

    assert attrs(s_path) == attrs(m_path)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 200, (1, 8), generator=gen).numpy()
    for mask in (np.ones((1, 8), dtype=np.int64), np.array([[1] * 5 + [0] * 3], dtype=np.int64)):
        a, b = _run(s_path, ids, mask), _run(m_path, ids, mask)
        assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lm_head only (tied)", "both stored (untied, Qwen3-8B)", "neither"])
def test_the_embedding_is_read_where_the_checkpoint_stores_it(tiny_qwen3, tmp_path, case) -> None:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from porting.errors import InputError
    from porting.export.streamed_text import stream_int4_text_encoder

    embed = load_file(tiny_qwen3 / "model.safetensors")["model.embed_tokens.weight"]
    if case.startswith("lm_head"):  # a tied checkpoint saved under the output projection's name
        src = _trimmed_encoder(tiny_qwen3, tmp_path / "src", 1, rename={"model.embed_tokens.weight": "lm_head.weight"})
    elif case.startswith("both"):  # untied: the input embedding is embed_tokens, never lm_head
        src = _trimmed_encoder(tiny_qwen3, tmp_path / "src", 1, extra={"lm_head.weight": torch.randn(embed.shape)},
                               config={"tie_word_embeddings": False})
    else:
        src = _trimmed_encoder(tiny_qwen3, tmp_path / "src", 1, rename={"model.embed_tokens.weight": "other"})
        with pytest.raises(InputError, match="no tensor model.embed_tokens.weight.*nor its tied twin lm_head"):
            stream_int4_text_encoder(src, ryzenai.Profile(size=32, text_len=8, block_size=16), tmp_path / "s")
        return
    proto, facts = stream_int4_text_encoder(src, ryzenai.Profile(size=32, text_len=8, block_size=16), tmp_path / "s")
    ryzenai.save_streamed(proto, tmp_path / "s", facts["file"], facts["data_file"])
    got = _inits(tmp_path / "s" / facts["file"])["encoder.model.embed_tokens.weight"]
    assert np.array_equal(got, embed.float().numpy())


MEMORY_CHILD = r"""
import json, resource, sys
from pathlib import Path
import diffusers, onnx, onnx_ir, onnxscript, onnxruntime, torch, transformers  # noqa: F401  (the baseline)
from porting.export import ryzenai
from porting.export.streamed_text import stream_int4_text_encoder
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
proto, facts = stream_int4_text_encoder(src, ryzenai.Profile(size=64, text_len=32, block_size=128), dest)
ryzenai.save_streamed(proto, dest, facts["file"], facts["data_file"])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "data": (dest / facts["data_file"]).stat().st_size}))
"""


@pytest.mark.slow
def test_streamed_text_encoder_memory_does_not_grow_with_real_width_layers(tmp_path) -> None:
    """Qwen3-4B's width (hidden 2560, MLP 9728: 0.4 GB of float32 per layer) at 2 and 5 layers: the export's peak RSS
    over the interpreter's grows by at most a small constant (not the 1.2 GB of float32 the 3 extra layers hold), and
    stays within 2.5 float32 copies of the largest Linear plus a graph allowance."""
    import os
    import subprocess

    from porting.demo.tiny import REAL_QWEN3, write_random_text_encoder

    geometry = {**REAL_QWEN3["qwen3-4b"], "vocab_size": 8192}
    largest = 4 * 2560 * 9728  # the MLP's gate/up/down weights in float32
    peaks = {}
    for layers in (2, 5):
        src = write_random_text_encoder(tmp_path / f"src{layers}", {**geometry, "num_hidden_layers": layers})
        out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(src), str(tmp_path / f"onnx{layers}")],
                             check=True, capture_output=True, text=True, cwd=Path(__file__).parents[1],
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        rss = json.loads(out.stdout.strip().splitlines()[-1])
        peaks[layers] = rss["peak"] - rss["base"]
        assert peaks[layers] <= 2.5 * largest + 256 * 2**20, (layers, rss)
        import shutil

        shutil.rmtree(src)
    assert peaks[5] - peaks[2] <= 128 * 2**20, peaks  # 3 more layers: 1.2 GB of float32 if they were held


# ---------------------------------------------------------------- the generic export, streamed

def _initializers(path: Path) -> dict:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    return {t.name: numpy_helper.to_array(t, base_dir=str(path.parent)) for t in model.graph.initializer}


@pytest.mark.slow
@pytest.mark.parametrize("variant, dtype", [("klein", "fp16"), ("flux1-dev", "fp32")])
def test_generic_streamed_export_equals_the_in_memory_one(tmp_path, variant, dtype) -> None:
    """Every component of the tiny bases (FLUX.2 klein: transformer, VAE decoder, Qwen3; FLUX.1 [dev]: transformer,
    VAE decoder, CLIP, T5 with its float32 `wo` in fp16) is streamed; its graph's weights are the in-memory export's
    bit for bit (dtype included) and onnxruntime computes the same output on the trace's example."""
    import numpy as np
    import torch

    from porting.demo.bases import write_tiny_base
    from porting.export.onnx import export_component, layout_of
    from porting.export.ort import open_session

    base = write_tiny_base(tmp_path / "base", variant)
    result = export_onnx(base, tmp_path / "s", dtype=dtype)
    assert all(c.facts.get("streamed") for c in result.components), [(c.name, c.facts) for c in result.components]
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert all(c["streamed"] for c in manifest["components"].values())
    layout = layout_of(base)
    for c in result.components:
        traced = layout.spec.components[c.name].load(layout.sources[c.name], {"fp16": torch.float16,
                                                                            "fp32": torch.float32}[dtype])
        export_component(traced, tmp_path / "m" / c.name, 18)
        s, m = _initializers(tmp_path / "s" / c.name / "model.onnx"), _initializers(tmp_path / "m" / c.name /
                                                                                   "model.onnx")
        params = [k for k, _ in traced.module.named_parameters() if k in m]
        assert params and all(k in s for k in params), c.name
        bad = [k for k in params if s[k].dtype != m[k].dtype or not np.array_equal(s[k], m[k])]
        assert not bad, (c.name, bad[:3])
        feed = {k: v.numpy() for k, v in traced.example.items()}
        got = open_session(tmp_path / "s" / c.name).run(None, feed)[0]
        want = open_session(tmp_path / "m" / c.name).run(None, feed)[0]
        assert np.array_equal(got, want), c.name


@pytest.mark.slow
def test_generic_export_refuses_before_any_work_when_the_streamed_estimate_does_not_fit(tmp_path, capsys) -> None:
    from porting.demo.bases import write_tiny_base
    from porting.resources import ResourceError

    base = write_tiny_base(tmp_path / "base", "klein")
    with pytest.raises(ResourceError) as exc:
        export_onnx(base, tmp_path / "out", dtype="fp16", components=["transformer"], available_bytes=2**30)
    assert "transformer: a streamed export needs about 3.00 GiB" in str(exc.value)
    assert "largest tensor single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight" in str(exc.value)
    assert not (tmp_path / "out").exists()


GENERIC_MEMORY_CHILD = r"""
import json, resource, sys
from pathlib import Path
import diffusers, onnx, onnx_ir, onnxscript, torch, transformers  # noqa: F401  (the baseline)
from porting.export.onnx import export_onnx
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
export_onnx(Path(sys.argv[1]), Path(sys.argv[2]), dtype="fp16", components=["transformer"])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak}))
"""


@pytest.mark.slow
def test_generic_streamed_export_memory_does_not_grow_with_real_width_blocks(tmp_path) -> None:
    """klein-9B's width (hidden 4096: a single block is 0.38 GB of float32) with 1 and 4 single blocks: the fp16
    export's peak RSS grows by far less than the 3 extra blocks (0.57 GB of fp16, 1.1 GB of float32)."""
    import os
    import subprocess

    from porting.demo.tiny import REAL_FLUX2, write_random_checkpoint

    peaks = {}
    for singles in (1, 4):
        cfg = {**REAL_FLUX2["klein-9b"], "num_layers": 1, "num_single_layers": singles}
        src = tmp_path / f"t{singles}"
        write_random_checkpoint(src / "diffusion_pytorch_model.safetensors", cfg, "diffusers", "BF16", seed=0,
                                fill="tiled")
        (src / "config.json").write_text(json.dumps(cfg))
        out = subprocess.run([sys.executable, "-c", GENERIC_MEMORY_CHILD, str(src), str(tmp_path / f"o{singles}")],
                             check=True, capture_output=True, text=True, cwd=Path(__file__).parents[1],
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        rss = json.loads(out.stdout.strip().splitlines()[-1])
        peaks[singles] = rss["peak"] - rss["base"]
        import shutil

        shutil.rmtree(src)
        shutil.rmtree(tmp_path / f"o{singles}")
    single_block_fp32 = 4 * (4096 * 3 * 4096 + 4096 * 2 * 3 * 4096 + 4 * 4096 * 4096)  # qkv+mlp in, out (approx.)
    assert peaks[4] - peaks[1] <= 0.25 * single_block_fp32, peaks


# ---------------------------------------------------------------- onnxruntime sessions with bounded memory

def _bf16_cast_graph(path: Path) -> Path:
    """y = x @ Cast(W_bf16): the ryzenai bf16-cast form in one node pair, saved with external data."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    init = helper.make_tensor("w", TensorProto.BFLOAT16, [64, 64], bits.tobytes(), raw=True)
    nodes = [helper.make_node("Cast", ["w"], ["w32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "w32"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [init])
    path.mkdir(parents=True)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path / "model.onnx"),
                    save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path


def test_sessions_open_lean_by_default(tmp_path) -> None:
    """What validate and generate open: no arena, no memory pattern, the threads asked (prepacking off on request)."""
    import numpy as np

    from porting.export.ort import SessionSettings, open_session

    folder = _bf16_cast_graph(tmp_path / "g")
    lean = open_session(folder, settings=SessionSettings(threads=1))
    opts = lean.get_session_options()
    assert not opts.enable_cpu_mem_arena and not opts.enable_mem_pattern and opts.intra_op_num_threads == 1
    unpacked = open_session(folder, settings=SessionSettings(prepack=False)).get_session_options()
    assert unpacked.get_session_config_entry("session.disable_prepacking") == "1"
    default = open_session(folder, settings=SessionSettings(lean=False))
    assert default.get_session_options().enable_cpu_mem_arena
    x = np.ones((1, 64), dtype=np.float32)
    assert np.array_equal(lean.run(None, {"x": x})[0], default.run(None, {"x": x})[0])  # same numbers


@pytest.mark.parametrize("argv, named", [
    (["validate", "{m}", "--ort-threads", "0"], "--ort-threads 0"),
    (["validate", "{m}", "--ort-threads", "2"], "only with --runtime onnxruntime"),
])
def test_ort_threads_is_refused_where_it_does_not_apply(tmp_path, capsys, argv, named) -> None:
    model = tmp_path / "m.safetensors"
    import torch
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, model)
    code, _, err = run_cli([a.replace("{m}", str(model)) for a in argv], capsys)
    assert code != 0 and named in err


def test_text_encoder_estimate_is_the_largest_linear_not_the_embedding(tmp_path) -> None:
    """The embedding is written in row chunks and never held whole: the estimate counts the largest Linear."""
    import torch
    from safetensors.torch import save_file

    from porting.export.streamed_text import CHUNK_BYTES, streamed_text_encoder_bytes
    from porting.resources import MEMORY_OVERHEAD, STREAMED_GRAPH_BYTES

    save_file({"model.embed_tokens.weight": torch.zeros(4096, 64, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    need, breakdown = streamed_text_encoder_bytes(tmp_path)
    assert need == MEMORY_OVERHEAD + STREAMED_GRAPH_BYTES + int(2.5 * 96 * 64 * 4) + CHUNK_BYTES
    assert "model.layers.0.mlp.up_proj.weight" in breakdown


@pytest.mark.slow
def test_generate_picks_the_graph_of_its_size_or_names_the_sizes(sized_export) -> None:
    from porting.errors import PortError
    from porting.pipeline.ort_pipeline import graph_for_size

    _, out, _ = sized_export
    assert graph_for_size(out, (48, 48)) == "model_48.onnx"
    with pytest.raises(PortError, match="32x32, 48x48 only; --size 64x64 has none"):
        graph_for_size(out, (64, 64))
