"""No traceback on any input (issue 21, item 9).

Each case is a hostile or damaged input run through the real CLI: it must end in the documented exit code (2 for an
input or option flux-port cannot use, 1 for a number it refuses to write), a message naming the file or option, no
traceback on stderr, and with --json exactly one JSON document on stdout. The classes behind them: one JSON reader
with a depth limit and type checks (porting/_files.py), one seed parser (porting/seeds.py), one image loader with a
pixel limit, typed config fields, and a last-resort mapping in the CLI entry.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from . import quantfiles as qf
from .helpers import TINY2, leftovers, mount_tmpfs, reference_model, run_port, save_state
from .lorakit import BFL_MODULES, BY_NAME, DIFFUSERS_MODULES, make_parts, weight_shapes, write_adapter
from .reference.flux2_bfl import Flux2Params

DEEP = "[" * 100_000 + "]" * 100_000  # Python's json recurses: RecursionError, not ValueError
NESTED = "[" * 65 + "]" * 65  # parses, but past flux-port's depth limit of 64
BIG_SEED = str(2**64)


@pytest.fixture(scope="module")
def state():
    return reference_model(TINY2, seed=7).state_dict()


def assert_refused(run, code: int, *phrases: str) -> dict:
    """The documented exit code, each phrase in the message, no traceback, one JSON document on stdout."""
    assert run.code == code, run.err
    assert "Traceback" not in run.err, run.err
    doc = json.loads(run.out)  # exactly one document: json.loads refuses trailing data
    assert doc["exit_code"] == code, doc
    for phrase in phrases:
        assert phrase in run.msg or phrase in doc["error"], run.msg
    return doc


def header_file(path: Path, header_text: str) -> Path:
    raw = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def copy_of(folder: Path, where: Path) -> Path:
    shutil.copytree(folder, where, symlinks=True)
    return where


def _adapter(folder: Path, state, naming: str = "peft-transformer", metadata: dict | None = None,
             extra: dict | None = None, name: str = "adapter.safetensors") -> Path:
    n = BY_NAME[naming]
    modules = DIFFUSERS_MODULES[:2] if n.diffusers_modules else [BFL_MODULES[0], BFL_MODULES[2]]
    parts = make_parts(weight_shapes(state, n.diffusers_modules), modules, n.kind, seed=3, alpha=n.alpha)
    path = write_adapter(folder / name, n, parts, extra=extra)
    if metadata is not None:
        save_file(load_file(str(path)), str(path), metadata=metadata)
    return path


# --- deeply nested JSON wherever JSON is read from a user: exit 2 naming the file ---------------------------------

def _deep_header(tmp: Path, port: dict, tiny2_file: Path) -> tuple[list, str]:
    return ["inspect", header_file(tmp / "deep.safetensors", '{"a":' + DEEP + "}")], "deep.safetensors"


def _nested_header(tmp: Path, port: dict, tiny2_file: Path) -> tuple[list, str]:
    return ["inspect", header_file(tmp / "nested.safetensors", '{"a":' + NESTED + "}")], "nested deeper than 64"


def _deep_index(tmp: Path, port: dict, tiny2_file: Path) -> tuple[list, str]:
    folder = tmp / "sharded"
    folder.mkdir()
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(DEEP)
    return ["inspect", folder], "diffusion_pytorch_model.safetensors.index.json"


def _deep_config(tmp: Path, port: dict, tiny2_file: Path) -> tuple[list, str]:
    folder = copy_of(port["transformer"], tmp / "transformer")
    (folder / "config.json").write_text('{"a":' + DEEP + "}")
    return ["inspect", folder], "config.json"


def _deep_config_export(tmp: Path, port: dict, tiny2_file: Path) -> tuple[list, str]:
    folder = copy_of(port["transformer"], tmp / "transformer")
    (folder / "config.json").write_text('{"a":' + DEEP + "}")
    return ["export", folder, "--out", tmp / "onnx"], "config.json"


def _deep_model_index(tmp: Path, port: dict, tiny2_file: Path) -> tuple[list, str]:
    folder = copy_of(port["base"], tmp / "pipe")
    (folder / "model_index.json").write_text('{"a":' + DEEP + "}")
    return ["generate", folder, "--prompt", "x", "--output", tmp / "x.png"], "model_index.json"


def _deep_report(tmp: Path, port: dict, tiny2_file: Path) -> tuple[list, str]:
    report = tmp / "report.json"
    report.write_text('{"a":' + DEEP + "}")
    return ["publish", "--base", port["base"], "--transformer", port["transformer"], "--report", report,
            "--out", tmp / "pub"], "report.json"


@pytest.mark.parametrize("make", [_deep_header, _nested_header, _deep_index, _deep_config, _deep_config_export,
                                  _deep_model_index, _deep_report], ids=lambda f: f.__name__.strip("_"))
def test_deeply_nested_json_is_an_input_error(capsys, tmp_path: Path, port: dict, tiny2_file: Path,
                                              make: Callable) -> None:
    argv, named = make(tmp_path, port, tiny2_file)
    run = run_port(capsys, *argv, "--json")
    code = 1 if argv[0] == "publish" else 2  # publish refuses an unreadable report as a failed gate (exit 1)
    assert_refused(run, code, named)


def test_deeply_nested_peft_metadata_is_an_input_error(capsys, tmp_path: Path, state) -> None:
    adapter = _adapter(tmp_path, state, metadata={"lora_adapter_metadata": '{"r":' + DEEP + "}"})
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "out", "--json")
    assert_refused(run, 2, str(adapter), "lora_adapter_metadata")
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("layers", ['{"layers":' + DEEP + "}", '{"layers": []}',
                                    '{"layers": {"double_blocks.0.img_attn.qkv": {"format": ["float8_e4m3fn"]}}}',
                                    '{"layers": {"double_blocks.0.img_attn.qkv": ["float8_e4m3fn"]}}'],
                         ids=["deep", "list-layers", "list-format", "list-entry"])
def test_bad_quantization_metadata_is_an_input_error(capsys, tmp_path: Path, state, layers: str) -> None:
    tensors, _, _ = qf.comfy_mixed(state, "float8_e4m3fn")
    src = qf.save(tmp_path / "mixed.safetensors", tensors, metadata={"_quantization_metadata": layers})
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--json")
    assert_refused(run, 2, "mixed.safetensors", "_quantization_metadata")
    assert leftovers(tmp_path / "out") == []


def test_a_comfy_quant_tensor_of_deep_json_is_an_input_error(capsys, tmp_path: Path, state) -> None:
    tensors, _, _ = qf.comfy_mixed(state, "float8_e4m3fn")
    key = next(k for k in tensors if k.endswith(".comfy_quant"))
    tensors[key] = torch.frombuffer(bytearray(b'{"a":' + NESTED.encode() + b"}"), dtype=torch.uint8)
    src = qf.save(tmp_path / "mixed.safetensors", tensors)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--json")
    assert_refused(run, 2, "mixed.safetensors", "comfy_quant", "nested deeper than 64")


# --- seeds: 0 <= seed < 2^63, the option named ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", [BIG_SEED, str(2**63), "-1"])
@pytest.mark.parametrize("verb", ["validate", "compare", "generate"])
def test_a_seed_out_of_range_is_refused_by_option(capsys, tmp_path: Path, port: dict, verb: str, seed: str) -> None:
    argv = {"validate": ["validate", port["transformer"], "--seeds", seed, "--out", tmp_path / "r"],
            "compare": ["compare", port["base"], port["base"], "--seeds", seed, "--out", tmp_path / "c"],
            "generate": ["generate", port["base"], "--prompt", "x", f"--seed={seed}", "--output", tmp_path / "x.png"]}
    run = run_port(capsys, *argv[verb], "--json")
    assert_refused(run, 2, "--seed", "2^63")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- adapter metadata and alphas ------------------------------------------------------------------------------------

@pytest.mark.parametrize("meta,code,phrase", [
    ({"r": 0, "lora_alpha": 8}, 1, "rank r = 0"),
    ({"r": 4, "lora_alpha": "eight"}, 2, "'eight'"),
    ({"r": 4, "lora_alpha": [8]}, 2, "lora_alpha [8]"),
    ({"r": [4], "lora_alpha": 8}, 2, "r [4]"),
    ({"r": 4, "lora_alpha": "1e999"}, 1, "lora_alpha"),
    (["r", 4], 2, "expected to be a JSON object, found list"),
], ids=["r0", "alpha-str", "alpha-list", "r-list", "alpha-inf", "list"])
@pytest.mark.parametrize("verb", ["convert", "merge"])
def test_bad_peft_metadata_is_refused(capsys, tmp_path: Path, state, meta, code: int, phrase: str,
                                      verb: str) -> None:
    adapter = _adapter(tmp_path, state, metadata={"lora_adapter_metadata": json.dumps(meta)})
    argv = ["convert", adapter] if verb == "convert" else [
        "merge", save_state(tmp_path / "base.safetensors", state), adapter]
    run = run_port(capsys, *argv, "--out", tmp_path / "out", "--json")
    assert_refused(run, code, str(adapter), phrase)
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("shape", [(0,), (2,), (1, 1, 0)])
def test_an_alpha_of_an_empty_or_odd_shape_is_refused(capsys, tmp_path: Path, state, shape) -> None:
    key = "lora_unet_double_blocks_0_img_attn_qkv.alpha"
    adapter = _adapter(tmp_path, state, "kohya")
    tensors = load_file(str(adapter))
    tensors[key] = torch.ones(shape)
    save_file(tensors, str(adapter))
    run = run_port(capsys, "convert", adapter, "--out", tmp_path / "out", "--json")
    assert_refused(run, 1, f"alpha {key!r} has shape {list(shape)}")


# --- GGUF truncated in its header or key-value section -------------------------------------------------------------

@pytest.mark.parametrize("cut", [3, 10, 20, 40, 200, "kv-end"])
def test_a_truncated_gguf_is_an_input_error(capsys, tmp_path: Path, state, cut) -> None:
    whole = tmp_path / "whole.gguf"
    qf.gguf_file(whole, state, "Q8_0")
    data = whole.read_bytes()
    if cut == "kv-end":  # inside the tensor infos, after the key-value section
        cut = data.index(b"double_blocks") + 5
    src = tmp_path / "cut.gguf"
    src.write_bytes(data[:cut])
    run = run_port(capsys, "inspect", src, "--json")
    assert_refused(run, 2, "cut.gguf")


# --- sizes and images beyond what a pipeline can do -----------------------------------------------------------------

def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height (and no pixels): the pixel limit must trip before any decode."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def test_compare_at_an_impossible_size_is_refused(capsys, tmp_path: Path, port: dict) -> None:
    run = run_port(capsys, "compare", port["base"], port["base"], "--size", "65536", "--out", tmp_path / "c",
                   "--json")
    assert_refused(run, 2, "65536")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("verb", ["compare", "generate", "bench"])
def test_a_huge_image_is_refused_before_decoding(capsys, tmp_path: Path, port: dict, verb: str) -> None:
    image = png_header_only(tmp_path / "huge.png", 20000, 20000)
    argv = {"compare": ["compare", port["base"], port["base"], "--image", image, "--out", tmp_path / "c"],
            "generate": ["generate", port["base"], "--prompt", "x", "--image", image, "--output", tmp_path / "x.png"],
            "bench": ["bench", port["base"], "--task", "edit", "--image", image, "--out", tmp_path / "b"]}[verb]
    run = run_port(capsys, *argv, "--json")
    assert_refused(run, 2, "huge.png", "larger than")


def test_bench_at_an_impossible_size_is_refused(capsys, tmp_path: Path, port: dict) -> None:
    run = run_port(capsys, "bench", port["base"], "--size", "32768", "--out", tmp_path / "b", "--json")
    assert_refused(run, 2, "32768")
    assert not (tmp_path / "b").exists()


def test_bench_with_a_transformer_of_another_geometry_is_refused(capsys, tmp_path: Path, port: dict) -> None:
    other = tmp_path / "other"  # text features 96 wide: the base's text encoder writes another width
    src = save_state(tmp_path / "wide.safetensors", reference_model(Flux2Params(**{**TINY2.__dict__,
                                                                                   "context_dim": 96})).state_dict())
    assert run_port(capsys, "convert", src, "--out", other).code == 0
    run = run_port(capsys, "bench", port["base"], "--transformer", other, "--out", tmp_path / "b", "--steps", "1",
                   "--runs", "1", "--warmup", "0", "--size", "64", "--json")
    assert_refused(run, 2, str(other), "joint_attention_dim")
    assert not (tmp_path / "b").exists()


# --- export: options and configs ------------------------------------------------------------------------------------

def test_export_opset_99_is_refused(capsys, tmp_path: Path, port: dict) -> None:
    run = run_port(capsys, "export", port["transformer"], "--opset", "99", "--out", tmp_path / "onnx", "--json")
    assert_refused(run, 2, "--opset 99")


@pytest.mark.parametrize("config,phrase", [
    ("[1, 2]", "expected a JSON object, found list"),
    ("not json", "not valid JSON"),
    (None, "'num_attention_heads' is '2'"),
], ids=["list", "not-json", "string-field"])
def test_export_refuses_a_bad_config(capsys, tmp_path: Path, port: dict, config, phrase: str) -> None:
    folder = copy_of(port["transformer"], tmp_path / "transformer")
    if config is None:
        doc = json.loads((folder / "config.json").read_text())
        doc["num_attention_heads"] = str(doc["num_attention_heads"])
        config = json.dumps(doc)
    (folder / "config.json").write_text(config)
    run = run_port(capsys, "export", folder, "--out", tmp_path / "onnx", "--json")
    assert_refused(run, 2, "config.json", phrase)
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("manifest", ["[1]", "{", '{"source": "x", "components": {"transformer": {}}}'],
                         ids=["list", "not-json", "string-source"])
def test_a_bad_export_manifest_is_an_input_error(capsys, tmp_path: Path, port: dict, manifest: str) -> None:
    folder = tmp_path / "onnx"
    (folder / "transformer").mkdir(parents=True)
    (folder / "flux-port-export.json").write_text(manifest)
    run = run_port(capsys, "generate", folder, "--prompt", "x", "--output", tmp_path / "x.png", "--json")
    assert_refused(run, 2, "flux-port-export.json")
    run = run_port(capsys, "validate", folder / "transformer", "--runtime", "onnxruntime", "--out", tmp_path / "r",
                   "--json")
    assert_refused(run, 2, "flux-port-export.json")


@pytest.mark.parametrize("manifest", ["[1]", "{", '{"to": "diffusers", "file": ["x"]}'],
                         ids=["list", "not-json", "list-file"])
def test_a_bad_adapter_manifest_is_an_input_error(capsys, tmp_path: Path, port: dict, state, manifest: str) -> None:
    folder = tmp_path / "lora"
    folder.mkdir()
    _adapter(folder, state, name="pytorch_lora_weights.safetensors")
    (folder / "flux-port-adapter.json").write_text(manifest)
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"], "--report",
                   port["pass"], "--adapter", folder, "--out", tmp_path / "pub", "--json")
    assert_refused(run, 2, "flux-port-adapter.json")
    assert not (tmp_path / "pub").exists()


@pytest.mark.parametrize("field,value", [("hidden_size", "64"), ("hidden_size", None), ("num_hidden_layers", 2.5)])
def test_a_mistyped_text_encoder_config_is_an_input_error(capsys, tmp_path: Path, port: dict, field: str,
                                                          value) -> None:
    base = copy_of(port["base"], tmp_path / "base")
    cfg_path = base / "text_encoder" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    target = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    if value is None:
        del target[field]
    else:
        target[field] = value
    cfg_path.unlink()  # a copy, never the shared fixture's file
    cfg_path.write_text(json.dumps(cfg))
    run = run_port(capsys, "publish", "--base", base, "--transformer", port["transformer"], "--report", port["pass"],
                   "--out", tmp_path / "pub", "--json")
    assert_refused(run, 2, "text_encoder/config.json", repr(field))
    assert not (tmp_path / "pub").exists()


# --- the last resort: whatever escapes the readers still ends in one message and a documented code -----------------

@pytest.mark.parametrize("exc,code,phrase", [
    (RecursionError("maximum recursion depth exceeded"), 2, "nested too deeply"),
    (MemoryError(), 2, "more memory than this machine has"),
    (ValueError("odd value"), 2, "cannot be read (ValueError: odd value)"),
    (RuntimeError("No space left on device (os error 28)"), 5, "the disk is full"),
    (TypeError("a flux-port bug"), 70, "internal error: TypeError: a flux-port bug"),
], ids=["recursion", "memory", "value", "disk-full", "bug"])
def test_an_escaped_exception_is_mapped_not_a_traceback(capsys, monkeypatch, tmp_path: Path, tiny2_file: Path,
                                                        exc: BaseException, code: int, phrase: str) -> None:
    import porting.tensors.checkpoint as checkpoint

    def reader(path, *args, **kwargs):  # `path` in the failing frame: the message names it
        raise exc

    monkeypatch.setattr(checkpoint, "open_checkpoint", reader)
    run = run_port(capsys, "inspect", tiny2_file, "--json")
    doc = assert_refused(run, code, phrase)
    if code == 2:
        assert str(tiny2_file) in doc["error"]


# --- a full disk: exit 5 naming the path, nothing half-built left ---------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 256 KiB filesystem (tmpfs) as in test_hardening; needs root, which CI and this machine have."""
    yield from mount_tmpfs(tmp_path / "small", "256k")


@pytest.mark.parametrize("existing", [False, True], ids=["new-workdir", "earlier-demo-workdir"])
def test_demo_on_a_full_disk_is_exit_5_and_leaves_no_half_built_folder(capsys, small_disk: Path,
                                                                       existing: bool) -> None:
    from porting.ownership import RECORD

    workdir = small_disk / "demo"
    if existing:  # an (empty) work folder an earlier demo claimed
        from porting.cli.demo_cmd import prepare_workdir

        prepare_workdir(workdir)
    (small_disk / "keep.txt").write_text("mine")
    run = run_port(capsys, "demo", "--workdir", workdir, "--json")
    assert_refused(run, 5, "the disk is full", str(workdir))
    if existing:
        assert sorted(p.name for p in workdir.iterdir()) == [RECORD]  # what the record covers: nothing
        assert "only its ownership record is left" in run.msg
    else:
        assert sorted(p.name for p in small_disk.iterdir()) == ["keep.txt"]
        assert "removed its partial work folder" in run.msg
    assert (small_disk / "keep.txt").read_text() == "mine"


def test_an_adapter_convert_on_a_full_disk_is_exit_5_and_leaves_nothing(capsys, small_disk: Path, tmp_path: Path,
                                                                         state) -> None:
    adapter = _adapter(tmp_path, state, "kohya")  # ~34 KB; the disk keeps less than that free
    (small_disk / "keep.txt").write_text("mine")
    (small_disk / "filler.bin").write_bytes(b"\0" * (256 * 1024 - 16 * 1024))
    run = run_port(capsys, "convert", adapter, "--out", small_disk / "out", "--json")
    assert_refused(run, 5, "the disk is full", str(small_disk / "out"))
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler.bin", "keep.txt"]
