"""Every error path: a clear message and exit code, never a traceback, and no output (nor staging folder) left."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from porting.engine.convert import convert
from porting.errors import InputError

from .helpers import leftovers, run_port, save_state, write_raw_safetensors


@pytest.fixture
def src(tmp_path, tiny2_state) -> Path:
    return save_state(tmp_path / "src" / "tiny.safetensors", tiny2_state, torch.bfloat16)


def convert_fails(capsys, src, out: Path, *extra: str, code: int = 2):
    run = run_port(capsys, "convert", src, "--out", out, *extra)
    assert run.code == code, (run.code, run.err)
    assert "Traceback" not in run.msg
    assert run.msg.startswith("Error: ")
    assert leftovers(out) == [], "a failed conversion left output behind"
    return run


# --- files that are not (valid) safetensors ------------------------------------------------------------------------

def test_not_a_safetensors_file(tmp_path, capsys):
    bad = tmp_path / "notes.safetensors"
    bad.write_text("These are my training notes, not weights. " * 10)
    run = convert_fails(capsys, bad, tmp_path / "out")
    assert "not a safetensors file (header length field says" in run.msg
    assert "Hint: Is this a pickle or GGUF file renamed" in run.msg


def test_file_shorter_than_a_header(tmp_path, capsys):
    bad = tmp_path / "empty.safetensors"
    bad.write_bytes(b"abc")
    run = convert_fails(capsys, bad, tmp_path / "out")
    assert "not a safetensors file (only 3 bytes)" in run.msg


def test_truncated_file(tmp_path, capsys, src):
    cut = tmp_path / "cut.safetensors"
    data = src.read_bytes()
    cut.write_bytes(data[:-100])  # an interrupted download
    run = convert_fails(capsys, cut, tmp_path / "out")
    assert "file is truncated: tensor" in run.msg and "Hint: Download the file again." in run.msg


F32_4 = {"dtype": "F32", "shape": [2, 2]}  # 16 bytes


@pytest.mark.parametrize("header, data, message", [
    # two tensors claim overlapping bytes
    ({"a": {**F32_4, "data_offsets": [0, 16]}, "b": {**F32_4, "data_offsets": [8, 24]}}, bytes(24),
     "header lies about offsets: tensor 'b' starts at 8, expected 16"),
    # offsets too short for the declared shape
    ({"a": {**F32_4, "data_offsets": [0, 8]}}, bytes(8),
     "header lies about tensor 'a': shape [2, 2] F32 needs 16 bytes, offsets [0, 8] give 8"),
    # a gap before the first tensor
    ({"a": {**F32_4, "data_offsets": [4, 20]}}, bytes(20), "header lies about offsets: tensor 'a' starts at 4"),
    # the data section is longer than what the header describes
    ({"a": {**F32_4, "data_offsets": [0, 16]}}, bytes(40), "data section holds 40 bytes but the header describes 16"),
    # the same key twice in the JSON header
    (None, bytes(16), "safetensors header is not valid JSON (key 'a' appears twice"),
])
def test_header_that_lies(tmp_path, capsys, header, data, message):
    bad = tmp_path / "liar.safetensors"
    if header is None:
        raw = b'{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"a":{"dtype":"F32","shape":[2,2],' \
              b'"data_offsets":[0,16]}}'
        bad.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    else:
        write_raw_safetensors(bad, header, data)
    run = convert_fails(capsys, bad, tmp_path / "out")
    assert message in run.msg


# --- files that are safetensors but not a known transformer --------------------------------------------------------

def test_unknown_architecture_names_the_markers_not_found(tmp_path, capsys):
    vae = save_state(tmp_path / "vae.safetensors", {"encoder.conv_in.weight": torch.zeros(4, 3, 3, 3),
                                                    "decoder.conv_out.weight": torch.zeros(3, 4, 3, 3)})
    run = convert_fails(capsys, vae, tmp_path / "out")
    assert "keys match no known architecture (2 tensors, e.g. 'decoder.conv_out.weight'" in run.msg
    assert "Markers not found:" in run.msg
    for marker in ("flux2 original: needs 'double_stream_modulation_img.lin.weight'",
                   "flux2 diffusers: needs 'x_embedder.weight'",
                   "flux1 original: needs 'vector_in.in_layer.weight'"):
        assert marker in run.msg
    assert "Is this a LoRA, a VAE" in run.msg


def test_unknown_architecture_points_at_the_near_miss(tmp_path, capsys, tiny2_state):
    """A FLUX.2 file with one renamed marker: the message shows the closest key present."""
    state = dict(tiny2_state)
    state["single_stream_mod.lin.weight"] = state.pop("single_stream_modulation.lin.weight")
    bad = save_state(tmp_path / "renamed.safetensors", state)
    run = convert_fails(capsys, bad, tmp_path / "out")
    assert "needs 'single_stream_modulation.lin.weight' (closest here: 'single_stream_mod.lin.weight')" in run.msg


class Trap:
    """Unpickling this runs code: it creates a file. A refused pickle leaves no such file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("suffix", [".ckpt", ".bin", ".pt"])
def test_pickle_checkpoints_are_refused_unopened(tmp_path, capsys, suffix):
    marker = tmp_path / "code-ran"
    ckpt = tmp_path / f"model{suffix}"
    ckpt.write_bytes(pickle.dumps({"img_in.weight": Trap(marker)}))
    run = convert_fails(capsys, ckpt, tmp_path / "out")
    assert f"pickle checkpoints ({suffix}) can run arbitrary code when loaded; flux-port refuses them" in run.msg
    assert "weights_only=True" in run.msg
    assert not marker.exists()
    # a folder holding only a pickle is refused the same way
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(ckpt, folder / f"diffusion_pytorch_model{suffix}")
    run = convert_fails(capsys, folder, tmp_path / "out")
    assert "pickle checkpoints" in run.msg and not marker.exists()


def test_missing_source(tmp_path, capsys):
    run = convert_fails(capsys, tmp_path / "nope.safetensors", tmp_path / "out")
    assert "nope.safetensors: no such file or folder" in run.msg


def test_sharded_folder_with_a_missing_shard(tmp_path, capsys, tiny2_state):
    folder = tmp_path / "sharded"
    keys = list(tiny2_state)
    save_state(folder / "model-00001-of-00002.safetensors", {k: tiny2_state[k] for k in keys[:20]})
    index = {"weight_map": {**dict.fromkeys(keys[:20], "model-00001-of-00002.safetensors"),
                            **dict.fromkeys(keys[20:], "model-00002-of-00002.safetensors")}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    run = convert_fails(capsys, folder, tmp_path / "out")
    assert "shard model-00002-of-00002.safetensors listed in the index is missing" in run.msg


# --- output folder rules -------------------------------------------------------------------------------------------

def test_existing_output_needs_force(tmp_path, capsys, src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    run = run_port(capsys, "convert", src, "--out", out)
    assert run.code == 2
    assert f"Error: {out}: output folder already exists." in run.msg and "Pass --force" in run.msg
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert leftovers(out) == ["out"]  # untouched, and no staging folder next to it
    # --force replaces only a folder flux-port wrote: this one holds the user's file, so it is refused too
    run = run_port(capsys, "convert", src, "--out", out, "--force", "-q")
    assert run.code == 2 and "was not written by flux-port" in run.msg and "nothing was changed" in run.msg
    assert (out / "precious.txt").read_text() == "keep me" and leftovers(out) == ["out"]
    mine = tmp_path / "mine"
    assert run_port(capsys, "convert", src, "--out", mine, "-q").code == 0
    first = (mine / "diffusion_pytorch_model.safetensors").stat().st_ino
    run = run_port(capsys, "convert", src, "--out", mine, "--force", "-q")
    assert run.code == 0, run.err
    assert (mine / "diffusion_pytorch_model.safetensors").stat().st_ino != first  # replaced by the new run
    assert leftovers(mine) == ["mine"]  # the replaced folder was cleaned up too


def test_convert_without_out_or_dry_run_is_a_usage_error(capsys, src):
    run = run_port(capsys, "convert", src)
    assert run.code == 2 and "port convert needs --out DIR (or --dry-run" in run.msg


# --- strict plan failures ------------------------------------------------------------------------------------------

def _strict_fails(tmp_path, capsys, state):
    bad = save_state(tmp_path / "bad.safetensors", state)
    run = convert_fails(capsys, bad, tmp_path / "out", "--strict", code=1)
    assert "strict plan failed" in run.msg and "nothing was written" in run.msg
    return run, bad


def test_strict_refuses_an_unexpected_key(tmp_path, capsys, tiny2_state):
    """A leftover quantization scale (ComfyUI fp8_scaled) must not be dropped silently."""
    state = {**tiny2_state, "double_blocks.0.img_attn.qkv.scale_weight": torch.ones(())}
    run, _ = _strict_fails(tmp_path, capsys, state)
    assert "1 problem(s)" in run.msg
    assert ("unexpected source double_blocks.0.img_attn.qkv.scale_weight "
            "(closest known: double_blocks.0.img_attn.qkv.weight)") in run.msg
    assert "scale_weight, comfy_quant" in run.msg  # the hint names the likely cause


def test_strict_refuses_a_missing_block_tensor(tmp_path, capsys, tiny2_state):
    state = dict(tiny2_state)
    del state["double_blocks.1.txt_mlp.0.weight"]
    run, _ = _strict_fails(tmp_path, capsys, state)
    assert "missing source double_blocks.1.txt_mlp.0.weight" in run.msg
    assert "not produced transformer_blocks.1.ff_context.linear_in.weight" in run.msg


def test_strict_refuses_a_misshaped_tensor(tmp_path, capsys, tiny2_state):
    state = {**tiny2_state, "single_blocks.1.linear2.weight": torch.zeros(64, 100)}
    run, _ = _strict_fails(tmp_path, capsys, state)
    # the user's own key is named next to the target key, so they can grep their file for it
    assert ("shape mismatch single_transformer_blocks.1.attn.to_out.weight (from single_blocks.1.linear2.weight in "
            "the file) produced [64, 100], model expects [64, 256]") in run.msg


def test_strict_failure_as_json(tmp_path, capsys, tiny2_state):
    state = {**tiny2_state, "double_blocks.0.img_attn.qkv.scale_weight": torch.ones(())}
    bad = save_state(tmp_path / "bad.safetensors", state)
    run = run_port(capsys, "convert", bad, "--out", tmp_path / "out", "--strict", "--json")
    assert run.code == 1
    doc = json.loads(run.out)  # exactly one JSON document on stdout
    assert doc["exit_code"] == 1 and "strict plan failed" in doc["error"]
    assert doc["report"]["problems"] == [{"kind": "unexpected source",
                                          "key": "double_blocks.0.img_attn.qkv.scale_weight",
                                          "closest": "double_blocks.0.img_attn.qkv.weight"}]
    assert leftovers(tmp_path / "out") == []


# --- failures in the middle of writing -----------------------------------------------------------------------------

def _fail_on_third_tensor(action):
    calls = []

    def on_bytes(n):
        calls.append(n)
        if len(calls) == 3:
            action()
    return on_bytes, calls


@pytest.mark.parametrize("shard_size", ["5GB", "20KB"], ids=["single file", "sharded output"])
def test_interrupt_mid_write_leaves_nothing(tmp_path, src, shard_size):
    def interrupt():
        raise KeyboardInterrupt  # what Ctrl-C raises in the main thread

    on_bytes, calls = _fail_on_third_tensor(interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", max_shard_size=shard_size, on_bytes=on_bytes)
    assert len(calls) == 3
    assert leftovers(tmp_path / "out") == []


def test_source_truncated_mid_write_leaves_nothing_and_keeps_the_old_output(tmp_path, src, capsys):
    """The source shrinks under the converter (disk, network share): a clean error, the previous output intact."""
    out = tmp_path / "out"
    assert run_port(capsys, "convert", src, "--out", out, "-q").code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    victim = tmp_path / "victim.safetensors"
    shutil.copy(src, victim)
    on_bytes, calls = _fail_on_third_tensor(lambda: os.truncate(victim, 1000))
    with pytest.raises(InputError, match="unexpected end of file while reading tensor"):
        convert(victim, out, force=True, on_bytes=on_bytes)
    assert 3 <= len(calls) < 49  # found mid-write, when the reads reach the cut (they run a little ahead)
    assert leftovers(out) == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# --- modes that must not write -------------------------------------------------------------------------------------

def test_dry_run_writes_nothing(tmp_path, capsys, src):
    out = tmp_path / "out"
    run = run_port(capsys, "convert", src, "--out", out, "--dry-run")
    assert run.code == 0, run.err
    assert "conversion plan" in run.out and "every key and shape accounted for" in run.out
    assert "41 -> 49 (target model: 49)" in run.out
    assert leftovers(out) == []


@pytest.mark.parametrize("argv", [
    ["inspect", "{src}", "--json"],
    ["convert", "{src}", "--dry-run", "--json"],
    ["convert", "{src}", "--out", "{out}", "--json"],
    ["convert", "{tmp}/nope.safetensors", "--out", "{out}", "--json"],
], ids=["inspect", "dry-run", "convert", "error"])
def test_json_mode_prints_one_json_document(tmp_path, capsys, src, argv):
    argv = [a.format(src=src, out=tmp_path / "out", tmp=tmp_path) for a in argv]
    run = run_port(capsys, *argv)
    doc = json.loads(run.out)  # raises if stdout holds anything but one JSON document
    assert isinstance(doc, dict)
    if "nope" in argv[1]:
        assert run.code == 2 and doc["exit_code"] == 2 and "no such file or folder" in doc["error"]
    else:
        assert run.code == 0, run.err
    if "--out" in argv and run.code == 0:
        assert doc["files"] == ["diffusion_pytorch_model.safetensors"]
        assert "weights_sha256" in doc  # null: port convert leaves the identity to validate (split tensors)

