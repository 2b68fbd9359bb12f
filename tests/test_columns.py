"""80 columns and plain text off a terminal: every verb's --help and the main tables, piped with COLUMNS=80, have no
line over 80 columns and no escape text (`\\x0a`); a table too wide goes vertical and keeps every value whole
(folded, never cut with an ellipsis); --json keeps the full values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.table import Table

from porting.cli import _output
from porting.cli.app import VERBS as REGISTERED

from .helpers import run_port
from .lorakit import BY_NAME, adapter_for

ESCAPED = re.compile(r"\\x[0-9a-f]{2}|\\u[0-9a-f]{4}")
VERBS = sorted(REGISTERED)


COMMAND = re.compile(r"^\s*(port|pip|python) ")  # a command to paste is printed whole, however long


def fits(text: str, width: int = 80) -> None:
    """No line over `width` columns but a command, no escape text, no ellipsis (a value cut short)."""
    for line in text.splitlines():
        assert len(line) <= width or COMMAND.match(line), f"{len(line)} columns: {line!r}"
        assert not ESCAPED.search(line), f"escape text: {line!r}"
        assert "…" not in line, f"a value cut short: {line!r}"


@pytest.fixture(autouse=True)
def columns_80(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


def test_every_verb_is_listed() -> None:
    assert {"fetch", "recipes", "inspect", "convert", "validate", "demo", "export", "env"} <= set(VERBS)


@pytest.mark.parametrize("argv", [["--help"], []] + [[verb, "--help"] for verb in VERBS])
def test_help_fits_80_columns_without_escape_text(capsys, argv: list[str]) -> None:
    run = run_port(capsys, *argv)
    assert run.code in (0, 2) and "Usage: port" in run.out + run.err
    fits(run.out)
    fits(run.err)


def test_recipes_fit_80_columns_and_json_keeps_every_value(capsys) -> None:
    run = run_port(capsys, "recipes")
    assert run.code == 0
    fits(run.out)
    assert "Flux2KleinPipeline" in run.out and "[klein]" in run.out and "\\[" not in run.out
    doc = json.loads(run_port(capsys, "recipes", "--json").out)
    for recipe in doc["recipes"]:
        assert recipe["name"] in run.out


def test_inspect_and_its_runtime_table_fit_80_columns(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    deep = tmp_path / ("a-folder-name-long-enough-to-push-every-path-past-eighty-columns-" * 2)
    deep.mkdir()
    weights = deep / "klein-tiny.safetensors"
    weights.write_bytes(tiny2_file.read_bytes())
    run = run_port(capsys, "inspect", weights)
    assert run.code == 0, run.err
    fits(run.out)
    assert "which runtime loads this file" in run.out and "port convert" in run.out
    full = json.loads(run_port(capsys, "inspect", weights, "--json").out)
    assert full["path"] == str(weights)  # --json: the full value, one string


def test_the_adapter_effect_table_fits_80_columns(capsys, tmp_path: Path, tiny2_file: Path, tiny2_state) -> None:
    adapter, _ = adapter_for(tmp_path / "style-lora.safetensors", BY_NAME["peft-transformer"], tiny2_state, seed=5)
    run = run_port(capsys, "inspect", adapter, "--base", tiny2_file, "--strength", "0.7")
    assert run.code == 0, run.err
    fits(run.out)
    assert "effect on" in run.out and "threshold" in run.out


def test_a_table_too_wide_goes_vertical_with_every_value_whole(capsys) -> None:
    """The shared seam (Output.table): a wide table with headers becomes `header  value` blocks; a multi-line cell
    made with cell() keeps its line breaks; a newline inside a plain cell (a name from a file) stays escaped."""
    long_path = "/" + "/".join(["components-of-a-long-path"] * 6) + "/model.onnx"
    table = Table(title="exported to somewhere (ONNX opset 18, fp32)")
    for col in ("component", "inputs", "parameters", "model.onnx", "weights", "path"):
        table.add_column(col)
    table.add_row("transformer", "hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids", "109,248",
                  "0.01 GB", "0.00 GB", long_path)
    table.add_row("vae_decoder", _output.cell("latent_sample", "second line"), "1", "0 GB", "0 GB", "x\ny")
    _output.Output().table(table)
    out = capsys.readouterr().out
    fits(out.replace("x\\x0ay", "xy"))
    assert "x\\x0ay" in out  # data from a file: its newline shown, not obeyed
    assert "latent_sample\n" in out and "second line" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("path "))
    column = lines[start].index("/")
    folded = [lines[start]] + [line for line in lines[start + 1:start + 4] if line[:column].strip() == ""]
    assert "".join(line[column:] for line in folded) == long_path  # folded across lines, never cut


def test_a_table_that_fits_is_left_a_table(capsys) -> None:
    table = Table(title="small")
    table.add_column("a")
    table.add_column("b")
    table.add_row("1", "2")
    _output.Output().table(table)
    out = capsys.readouterr().out
    assert "┃ a" in out or "│ 1" in out
    fits(out)


def test_help_examples_are_continued_not_cut() -> None:
    text = "\b\nExamples:\n  port generate ./my-klein-ft --prompt \"a red fox in the snow\" --device npu:0 --steps 4 " \
           "--output fox.png   (a note that says what it does)\n"
    fitted = _output.examples(text)
    assert all(len(line) <= 76 for line in fitted.splitlines())
    assert fitted.splitlines()[2].endswith(" \\") and "\"a red fox in the snow\"" in fitted
    assert fitted.splitlines()[-1].strip() == "(a note that says what it does)"


def test_a_table_whose_words_would_fit_only_at_their_minimum_is_not_cut(capsys) -> None:
    """The export summary: every column's longest word fits 80 columns in sum, yet rich, shrinking columns by
    ratio, would cut `encoder_hidden_states,` with an ellipsis; such a table goes vertical too."""
    table = Table(title="exported to onnx1 (ONNX opset 18, fp32)")
    for col in ("component", "inputs", "parameters", "graph", "external data", "time"):
        table.add_column(col)
    table.add_row("transformer", "hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids", "109,248",
                  "0.003 GB", "0.000 GB", "19.4 s")
    _output.Output().table(table)
    out = capsys.readouterr().out
    fits(out)
    assert "encoder_hidden_states," in out


def test_a_key_value_table_whose_longest_value_fills_the_line_is_not_cut(capsys) -> None:
    """A sha256 (64 characters) beside a 12-character key: 83 columns with the borders; vertical, whole."""
    table = Table(title="conversion plan", show_header=False)
    table.add_row("quantized to", "ComfyUI scaled fp8: BF16 x 22, float8_e4m3fn x scale_weight x 19")
    table.add_row("file sha256", "1a052891436af6030357d767533c981ddf481f1c420558358e3c9d40699c1234")
    _output.Output().table(table)
    out = capsys.readouterr().out
    fits(out)
    assert "1a052891436af6030357d767533c981ddf481f1c420558358e3c9d40699c1234" in out


def _on_a_terminal(argv: list[str], cwd: Path) -> tuple[int, str]:
    """`port ARGV` with stdout and stderr on a pseudo-terminal of 80 columns: (exit code, what it showed)."""
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-m", "porting", *argv], stdin=slave, stdout=slave, stderr=slave,
                          env=env, cwd=cwd, timeout=120)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the other side closed: everything was read
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return done.returncode, shown.decode().replace("\r\n", "\n")


def test_messages_on_a_terminal_wrap_at_spaces_and_piped_stay_one_line(tmp_path, capsys, monkeypatch) -> None:
    """Issue 30, item 5: an error and its hint wrap at word boundaries to a terminal's 80 columns (a terminal cut
    words at its edge), the path inside the current folder shown relative to it; piped with no $COLUMNS (shells do
    not export it), each stays one line for grep."""
    missing = tmp_path / ("a-long-folder-name-" * 3) / "model.safetensors"
    code, shown = _on_a_terminal(["inspect", str(missing)], tmp_path)
    assert code == 2
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    assert len(shown.splitlines()) > 1 and str(tmp_path) not in shown
    assert "\n  a-long-folder-name-a-long-folder-name-a-long-folder-name-/model.safetensors:\n" in shown
    monkeypatch.delenv("COLUMNS")
    monkeypatch.chdir(tmp_path)
    piped = run_port(capsys, "inspect", missing)
    assert piped.code == 2 and " ".join(shown.split()) == " ".join(piped.err.split())
    assert len(piped.err.splitlines()) < len(shown.splitlines())


def test_the_verbs_a_message_keeps_whole_are_the_registered_ones() -> None:
    from porting.text import PORT_VERBS

    assert PORT_VERBS == set(REGISTERED)


def test_no_command_or_digest_is_broken_at_80_columns_piped(capsys, tmp_path, monkeypatch, tiny2_state) -> None:
    """Piped with COLUMNS=80: the hint's command is on one line (pasted, a broken one runs as two commands) and the
    weights sha256 is one word on one line, though its label is wide enough to leave it 62 columns beside it."""
    from safetensors.torch import save_file

    from . import quantfiles as qf

    monkeypatch.chdir(tmp_path)
    tensors, _, _ = qf.comfy_mixed(tiny2_state, "float8_e4m3fn")  # `dequantized from`: a 16-column label
    save_file(tensors, "klein-fp8-comfy.safetensors")
    out = "a-folder-with-a-long-name/and-one-more-level/transformer"
    run = run_port(capsys, "convert", "klein-fp8-comfy.safetensors", "--out", out)
    assert run.code == 0, run.err
    fits(run.out + run.err)
    digest = json.loads((tmp_path / out / "flux-port.json").read_text())["weights_sha256"]
    assert any(line.strip() == digest or line.split()[-1:] == [digest] for line in run.out.splitlines()), run.out
    command = f"port validate {out} --device cpu"
    assert any(line.strip() == command for line in run.err.splitlines()), run.err
    run = run_port(capsys, "inspect", "klein-fp8-comfy.safetensors")  # its runtime table suggests commands
    commands = [line.strip() for line in run.out.splitlines() if line.strip().startswith("port convert")]
    assert commands and all(c.startswith("port convert klein-fp8-comfy.safetensors") and " --out " in c
                            for c in commands), run.out
    assert "config.timestep_guidance_channels" in run.out  # a label longer than the label column, whole
