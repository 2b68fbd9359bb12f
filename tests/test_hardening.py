"""Hostile and clumsy input: exit codes as documented, one JSON document with --json, no traceback, nothing left
behind, options refused before work, text from files shown and never obeyed."""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

from porting.errors import UnsupportedFormatError, UsageError
from porting.pipeline.publish import model_card, publish

from .helpers import leftovers, mount_tmpfs, run_port, save_state
from .test_safety import assert_clean_refusal, snapshot

# --- usage errors: exit 2, a message, nothing written ------------------------------------------------------------

@pytest.mark.parametrize("size", ["abc", "-1GB", "0", "nanGB", "5XB"])
def test_bad_max_shard_size_is_a_usage_error(capsys, tmp_path: Path, tiny2_file: Path, size: str) -> None:
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "out", "--max-shard-size", size)
    assert_clean_refusal(run, 2, f"--max-shard-size {size!r}")
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("args,phrase", [
    (["--seeds", ""], "--seeds ''"),
    (["--seeds", "0,,1"], "--seeds '0,,1'"),
    (["--seeds", "0.5"], "seeds are integers"),
    (["--timesteps", ""], "--timesteps ''"),
    (["--timesteps", "1.5"], "--timesteps 1.5"),
    (["--timesteps", "nan"], "--timesteps nan"),
    (["--resolution", "0"], "--resolution 0"),
    (["--resolution", "-64"], "--resolution -64"),
    (["--text-len", "0"], "--text-len 0"),
    (["--text-len", "-3"], "--text-len -3"),
    (["--max-ratio", "nan"], "--max-ratio nan"),
    (["--max-ratio", "-1"], "--max-ratio -1.0"),
])
def test_degenerate_validate_options_are_refused_before_any_work(capsys, tmp_path: Path, tiny2_file: Path,
                                                                 args: list[str], phrase: str) -> None:
    out = tmp_path / "reports"
    run = run_port(capsys, "validate", tiny2_file, "--out", out, *args)
    assert_clean_refusal(run, 2, phrase)
    assert not out.exists()  # refused as bad options, never reported as the model's fault


def test_a_bad_option_value_with_json_prints_one_json_error(capsys, tiny2_file: Path) -> None:
    run = run_port(capsys, "validate", tiny2_file, "--resolution", "abc", "--json")
    assert run.code == 2 and "Traceback" not in run.err
    doc = json.loads(run.out)
    assert doc["exit_code"] == 2 and "--resolution" in doc["error"]


def test_an_unknown_option_with_json_prints_one_json_error(capsys, tiny2_file: Path) -> None:
    run = run_port(capsys, "convert", tiny2_file, "--frobnicate", "--json")
    assert run.code == 2 and json.loads(run.out)["exit_code"] == 2 and "--frobnicate" in run.msg


def test_a_failing_validation_with_json_prints_exactly_one_document(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    # a threshold no bf16 run can meet: the verdict is fail, exit 1, and stdout holds the report alone
    run = run_port(capsys, "validate", tiny2_file, "--out", tmp_path / "r", "--resolution", "32", "--text-len", "8",
                   "--timesteps", "1.0", "--max-ratio", "0.0001", "--json")
    assert run.code == 1, run.err
    doc = json.loads(run.out)  # one document: json.loads refuses trailing data
    assert doc["verdict"] == "fail" and "Validation failed" in run.msg


# --- Ctrl-C ------------------------------------------------------------------------------------------------------

def _interrupting(monkeypatch: pytest.MonkeyPatch) -> None:
    import porting.engine.convert as engine

    real = engine.write_shards

    def write_then_interrupt(folder, *args, **kwargs):
        (Path(folder) / "diffusion_pytorch_model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "write_shards", write_then_interrupt)
    assert real is not write_then_interrupt


def test_ctrl_c_says_what_was_removed_and_exits_130(capsys, monkeypatch, tmp_path: Path, tiny2_file: Path) -> None:
    _interrupting(monkeypatch)
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "out")
    assert run.code == 130 and "Traceback" not in run.err
    assert run.err.count("Interrupted") == 1 and "the output being written was removed" in run.msg
    assert leftovers(tmp_path / "out") == []


def test_ctrl_c_with_json_prints_a_json_document(capsys, monkeypatch, tmp_path: Path, tiny2_file: Path) -> None:
    _interrupting(monkeypatch)
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "out", "--json")
    assert run.code == 130 and json.loads(run.out)["exit_code"] == 130


# --- races -------------------------------------------------------------------------------------------------------

def test_a_source_rewritten_during_convert_leaves_no_output(capsys, monkeypatch, tmp_path: Path,
                                                           tiny2_file: Path) -> None:
    import porting.engine.convert as engine

    src = tmp_path / "src.safetensors"
    src.write_bytes(tiny2_file.read_bytes())
    real = engine.write_shards

    def write_while_someone_rewrites(*args, **kwargs):
        names = real(*args, **kwargs)
        os.utime(src, ns=(1, 1))  # another process touched the file while it was being read
        return names

    monkeypatch.setattr(engine, "write_shards", write_while_someone_rewrites)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out")
    assert_clean_refusal(run, 2, "the source changed while it was being converted", "nothing was written")
    assert leftovers(tmp_path / "out") == []


# --- unwritable and full outputs ---------------------------------------------------------------------------------

def test_an_output_under_a_regular_file_is_refused_up_front(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    run = run_port(capsys, "convert", tiny2_file, "--out", blocker / "out")
    assert_clean_refusal(run, 2, "is a file, not a folder")
    assert blocker.read_text() == "a file"


def test_a_dangling_link_as_output_is_refused(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    run = run_port(capsys, "convert", tiny2_file, "--out", link)
    assert_clean_refusal(run, 2, "dangling symbolic link")
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 256 KiB filesystem (tmpfs), mounted for the test; needs root, which CI and this machine have."""
    yield from mount_tmpfs(tmp_path / "small", "256k")


def test_a_full_disk_mid_write_is_exit_5_and_leaves_nothing(capsys, small_disk: Path, tmp_path: Path,
                                                            tiny2_state) -> None:
    import torch

    src = save_state(tmp_path / "big.safetensors", tiny2_state, torch.float32)  # ~0.4 MB: larger than the disk
    (small_disk / "keep.txt").write_text("mine")
    run = run_port(capsys, "convert", src, "--out", small_disk / "out")
    assert_clean_refusal(run, 5, "the disk is full", "the partial output was removed")
    assert sorted(p.name for p in small_disk.iterdir()) == ["keep.txt"]


def test_a_read_only_filesystem_is_refused_before_work(capsys, small_disk: Path, tiny2_file: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    run = run_port(capsys, "convert", tiny2_file, "--out", small_disk / "out")
    assert_clean_refusal(run, 2, "cannot write")


# --- text from files reaches the terminal and the card escaped ---------------------------------------------------

def test_a_tensor_name_with_terminal_escapes_is_shown_not_obeyed(capsys, tmp_path: Path, tiny2_state) -> None:
    evil = "\x1b[2J\x1b[H" + "double_blocks.0.evil.weight"
    src = save_state(tmp_path / "evil.safetensors", {**tiny2_state, evil: tiny2_state["img_in.weight"].clone()})
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out")
    assert run.code == 1 and "\x1b" not in run.err
    assert "\\x1b[2J\\x1b[H" + "double_blocks.0.evil.weight" in run.err


def test_a_base_model_with_markup_is_refused(port: dict, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--base-model"):
        publish(port["base"], port["transformer"], tmp_path / "pub", report=port["pass"],
                base_model='x/y"><script>alert(1)</script>')
    assert not (tmp_path / "pub").exists()


def test_a_folder_name_with_quotes_keeps_the_snippet_valid_python(port: dict, tmp_path: Path) -> None:
    out = tmp_path / 'my "klein" ](x) <b>'
    publish(port["base"], port["transformer"], out, report=port["pass"])
    card = (out / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    tree = ast.parse(snippet)  # valid Python
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") ==
                "from_pretrained")
    assert call.args[0].value == out.name
    title = next(line for line in card.splitlines() if line.startswith("# "))
    assert title == '# my "klein" \\]\\(x\\) \\<b\\>'  # markdown and HTML shown, not interpreted


def test_model_card_escapes_every_recorded_value(port: dict) -> None:
    from porting.pipeline.publish import Gate

    card = model_card(name="n", base_model="org/base", base=port["base"], variant="klein", weights="w",
                      gate=Gate("missing", "none"), skip_validation=True,
                      convert_manifest={"source": "/x/evil`|<img>.safetensors", "table": "flux2"})
    row = next(line for line in card.splitlines() if line.startswith("| source file"))
    assert row == "| source file | `evil'\\|<img>.safetensors` |"


# --- publish refuses what convert refuses ------------------------------------------------------------------------

def test_a_base_holding_pickle_weights_is_refused(port: dict, tmp_path: Path) -> None:
    import shutil

    base = tmp_path / "base"
    shutil.copytree(port["base"], base)
    (base / "text_encoder" / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    before = snapshot(tmp_path)
    with pytest.raises(UnsupportedFormatError, match="pickle weights.*pytorch_model.bin"):
        publish(base, port["transformer"], tmp_path / "pub", report=port["pass"])
    assert snapshot(tmp_path) == before


# --- hints work when followed --------------------------------------------------------------------------------------

def test_convert_of_an_unfetched_recipe_says_fetch_it(capsys, tmp_path: Path) -> None:
    from porting.hub.recipes import load_recipes

    name = next(iter(load_recipes()))
    run = run_port(capsys, "convert", name, "--workspace", tmp_path / "ws")
    assert_clean_refusal(run, 2, f"recipe {name} is not fetched yet", f"port fetch {name}")


def test_validate_hint_for_an_original_file_says_convert_first() -> None:
    from porting.cli.validate_cmd import next_step_hint

    hint = next_step_hint(Path("/x/ft.safetensors"), Path("/x/reports"), None)
    assert "port convert /x/ft.safetensors --out TRANSFORMER_DIR --strict" in hint
    assert next_step_hint(Path("/x"), Path("/x/reports"), "r1") == "publish it next: port publish r1"


# --- publish gates on what the model computes ----------------------------------------------------------------------

def test_a_config_edited_after_validation_is_not_published(port: dict, tmp_path: Path) -> None:
    import shutil

    from porting.errors import CheckFailed

    from .tinyport import write_report

    transformer = tmp_path / "transformer"
    shutil.copytree(port["transformer"], transformer)
    report = write_report(tmp_path / "reports", port["weights"])
    config = json.loads((transformer / "config.json").read_text())
    config["rope_theta"] = 10000  # same weights, another function
    (transformer / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckFailed, match=r"config.json changed since .* \(rope_theta\)"):
        publish(port["base"], transformer, tmp_path / "pub", report=report)
    assert not (tmp_path / "pub").exists()


def test_an_onnxruntime_report_does_not_publish_the_torch_transformer(port: dict, tmp_path: Path) -> None:
    from porting.errors import CheckFailed

    from .tinyport import report_doc

    doc = {**report_doc(port["weights"]), "runtime": "onnxruntime"}
    (tmp_path / "report.json").write_text(json.dumps(doc))
    with pytest.raises(CheckFailed, match="validated a onnxruntime export, not this torch transformer"):
        publish(port["base"], port["transformer"], tmp_path / "pub", report=tmp_path / "report.json")


# --- no silent wrong numbers ---------------------------------------------------------------------------------------

def test_a_cast_that_would_overflow_is_refused(capsys, tmp_path: Path, tiny2_state) -> None:
    import torch

    state = {k: v.clone() for k, v in tiny2_state.items()}
    state["img_in.weight"][0, 0] = 1e5  # beyond fp16's 65504
    src = save_state(tmp_path / "big.safetensors", state, torch.float32)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out", "--dtype", "fp16")
    assert_clean_refusal(run, 1, "img_in.weight: x_embedder.weight would overflow fp16", "100000")
    assert leftovers(tmp_path / "out") == []
    assert run_port(capsys, "convert", src, "--out", tmp_path / "ok", "--dtype", "bf16", "-q").code == 0


def test_q_k_v_of_different_dtypes_are_not_fused_into_the_first_ones(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", folder, "-q").code == 0
    shard = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(str(shard))
    state["transformer_blocks.0.attn.to_k.weight"] = state["transformer_blocks.0.attn.to_k.weight"].to(torch.float32)
    save_file(state, str(shard), metadata={"format": "pt"})
    run = run_port(capsys, "convert", folder, "--to", "original", "--out", tmp_path / "orig")
    assert_clean_refusal(run, 1, "parts of different dtypes (BF16, F32) would be fused", "pass --dtype")
    assert leftovers(tmp_path / "orig") == []


# --- malformed input: exit 2, the file and the fault named --------------------------------------------------------

def _raw(path: Path, header: dict, data: bytes = b"\0" * 16) -> Path:
    from .helpers import write_raw_safetensors

    return write_raw_safetensors(path, header, data)


@pytest.mark.parametrize("entry,phrase", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}, "x.weight"),
    ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, "x.weight"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "x.weight"),
    ({"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}, "x.weight"),
])
def test_malformed_header_entries_are_input_errors(capsys, tmp_path: Path, entry: dict, phrase: str) -> None:
    src = _raw(tmp_path / "bad.safetensors", {"x.weight": entry})
    run = run_port(capsys, "inspect", src)
    assert_clean_refusal(run, 2, str(src), phrase)


@pytest.mark.parametrize("index", [[1, 2], {"weight_map": ["a"]}, {"weight_map": {"x": 3}}])
def test_malformed_index_files_are_input_errors(capsys, tmp_path: Path, index) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    run = run_port(capsys, "inspect", folder)
    assert_clean_refusal(run, 2, "model.safetensors.index.json")


def test_a_config_json_that_is_not_an_object_is_an_input_error(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    folder = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", folder, "-q").code == 0
    (folder / "config.json").write_text("[1, 2]")
    run = run_port(capsys, "inspect", folder)
    assert_clean_refusal(run, 2, "config.json")


def test_a_config_option_that_is_a_json_list_is_an_input_error(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "out", "--config", config)
    assert_clean_refusal(run, 2, str(config), "JSON object")


def test_a_fifo_as_the_source_is_refused_without_blocking(capsys, tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    run = run_port(capsys, "inspect", fifo)
    assert_clean_refusal(run, 2, str(fifo), "not a regular file")
