"""Lines that carry long paths fit 80 columns: run from a folder whose path is 130 characters long, with COLUMNS=80
and output piped, no line that demo / convert / validate / publish / compare print is wider than 80 columns, but a
command to paste (whole on its own line). A path inside the current folder is shown relative to it; one outside is
broken after a `/`, except inside a command; --json keeps it absolute."""

from __future__ import annotations

import json
from pathlib import Path

from porting.text import for_console, relative_paths, wrap_lines

from .helpers import run_port

SMALL = ("--resolution", "64", "--text-len", "32", "--timesteps", "1.0")


def deep_folder(root: Path, length: int = 130) -> Path:
    """A folder under `root` whose absolute path is at least `length` characters, in 30-character components."""
    folder = root
    while len(str(folder)) < length:
        folder = folder / f"a-folder-name-of-30-chars-{len(folder.parts):02d}"
    folder.mkdir(parents=True)
    return folder


def too_wide(*texts: str, width: int = 80) -> list[str]:
    """Lines wider than `width`, but a command to paste (printed whole, however long: a broken one pastes as two)."""
    return [line for text in texts for line in text.splitlines()
            if len(line) > width and not line.lstrip().startswith(("port ", "pip ", "python "))]


def test_relative_paths_inside_the_current_folder_only() -> None:
    here = "/work/a-folder"
    text = (f"report: {here}/reports/r.json and {here} ('{here}/x'), {here}-other/y, /work/a-folder2/z, "
            f"--out={here}/-odd")
    assert relative_paths(text, here) == ("report: reports/r.json and . ('x'), /work/a-folder-other/y, "
                                          "/work/a-folder2/z, --out=./-odd")
    assert relative_paths(f"x {here}/y", "/") == f"x {here}/y"  # from / every path is inside: left absolute


def test_a_path_longer_than_the_line_is_broken_after_a_separator() -> None:
    path = "/" + "/".join(["a-folder-name-of-thirty-chars-x"] * 5) + "/report.json"
    command = f"port publish --report {path} --base BASE_DIR --out DIR"
    # in a command it is not broken: the command is one line to paste, whole
    assert wrap_lines(f"Hint: publish it next: {command}", 80).splitlines() == ["Hint: publish it next:",
                                                                              f"  {command}"]
    text = f"Error: the report {path} validated other weights; validate this transformer again"
    wrapped = wrap_lines(text, 80)
    lines = wrapped.splitlines()
    assert not too_wide(wrapped) and len(lines) > 2
    joined = lines[0]
    for line in lines[1:]:  # a line ends after a `/` (the path goes on) or at a space
        joined += ("" if joined.endswith("/") else " ") + line.strip()
    assert joined == text
    assert wrap_lines("[4/6] " + "x" * 200, 80).splitlines()[1].startswith("      x")  # folded under its label


def test_a_long_path_in_a_vertical_table_is_broken_after_a_separator(capsys, monkeypatch) -> None:
    from rich.table import Table

    from porting.cli import _output

    monkeypatch.setenv("COLUMNS", "80")
    path = "/" + "/".join(["a-folder-name-of-thirty-chars-x"] * 5) + "/pub"
    table = Table(title="published", show_header=False)
    table.add_row("folder", path)
    table.add_row("weights sha256", "37a4099f3392512834dc1b9bb0911905e7b43c220aa7a8e6e252c971132d69c8")
    _output.Output().table(table)
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("folder "))
    column = lines[start].index("/")
    block = [lines[start]] + [line for line in lines[start + 1:] if line[:column].strip() == ""]
    assert not too_wide(*lines) and len(block) > 1
    assert all(line.endswith("/") for line in block[:-1]), block  # broken after a separator, not mid-name
    assert "".join(line[column:] for line in block) == path


class _Console:
    def __init__(self, terminal: bool) -> None:
        self.is_terminal, self.width = terminal, 80


def test_piped_without_columns_a_message_stays_one_line(monkeypatch) -> None:
    text = "Warning: " + "word " * 40
    monkeypatch.delenv("COLUMNS", raising=False)
    assert for_console(text, _Console(terminal=False)) == text
    assert not too_wide(for_console(text, _Console(terminal=True)))
    monkeypatch.setenv("COLUMNS", "80")
    assert not too_wide(for_console(text, _Console(terminal=False)))


def test_the_verbs_fit_80_columns_from_a_deep_folder(port, tmp_path, capsys, monkeypatch) -> None:
    """convert, validate, publish and compare on the tiny port, run from a 130-character folder with paths inside
    it (given absolute and relative) and outside it; piped with COLUMNS=80. --json keeps absolute paths."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # no LPIPS backbone: compare warns
    here = deep_folder(tmp_path)
    monkeypatch.chdir(here)
    outside = deep_folder(tmp_path / "elsewhere")
    runs = {
        "convert": run_port(capsys, "convert", port["source"], "--out", here / "t"),
        "convert outside": run_port(capsys, "convert", port["source"], "--out", outside / "t"),
        "validate": run_port(capsys, "validate", here / "t", *SMALL),
        "validate outside": run_port(capsys, "validate", outside / "t", *SMALL),
        "publish": run_port(capsys, "publish", "--base", port["base"], "--transformer", "t", "--out", here / "p"),
        "compare": run_port(capsys, "compare", "p", here / "p", "--steps", "1", "--size", "32", "-p", "a fox"),
    }
    for name, run in runs.items():
        assert run.code == 0, (name, run.err)
        assert not too_wide(run.out, run.err), (name, too_wide(run.out, run.err))
    assert "report: reports/validate/" in runs["validate"].err  # inside: relative, one line
    prose = "\n".join(line for line in runs["validate outside"].err.splitlines()
                      if not line.lstrip().startswith("port "))  # a command holds its paths whole
    assert str(outside) not in prose  # outside: broken after a separator...
    assert str(outside) in "".join(prose.split())  # ...whole once the breaks are removed
    hint = [line.strip() for line in runs["convert outside"].err.splitlines() if "port validate" in line]
    assert hint == [f"port validate {outside / 't'} --device cpu"]  # a command, whole on its line
    assert "LPIPS" in runs["compare"].err
    doc = json.loads(run_port(capsys, "convert", port["source"], "--out", here / "j", "--json").out)
    assert str(here / "j") in json.dumps(doc)


def test_the_demo_fits_80_columns_from_a_deep_folder(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(deep_folder(tmp_path))
    run = run_port(capsys, "demo")
    assert run.code == 0, run.err
    assert not too_wide(run.out, run.err), too_wide(run.out, run.err)
