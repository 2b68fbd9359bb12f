"""Each input file is opened once per command for its header and its data, through one positioned reader
(porting/tensors/files.py): a command that reopens a file per tensor read (117 opens for a tiny SVDQuant convert
before) fails here. Counted by wrapping the opens Python makes (`open`, `io.open`, `os.open`) around the command,
run in this process."""

from __future__ import annotations

import builtins
import io
import os
from collections import Counter
from pathlib import Path

import pytest

from . import quantfiles as qf
from .helpers import run_port
from .lorakit import BY_NAME, adapter_for

LIMIT = 3  # the header and the data (one descriptor), and at most one more: a stamp re-check or a format probe


@pytest.fixture
def count_opens(monkeypatch):
    """Counter of opens by absolute path, for the files of interest, while the test runs."""
    counts: Counter[str] = Counter()
    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open

    def note(file) -> None:
        if isinstance(file, (str, os.PathLike)):
            counts[os.path.abspath(os.fspath(file))] += 1

    def wrapped_open(file, *a, **k):
        note(file)
        return real_open(file, *a, **k)

    def wrapped_io_open(file, *a, **k):
        note(file)
        return real_io_open(file, *a, **k)

    def wrapped_os_open(path, *a, **k):
        note(path)
        return real_os_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", wrapped_open)
    monkeypatch.setattr(io, "open", wrapped_io_open)
    monkeypatch.setattr(os, "open", wrapped_os_open)
    return counts


def _opens(counts: Counter, *files: Path) -> dict[str, int]:
    return {f.name: counts[os.path.abspath(f)] for f in files}


def _check(counts: Counter, *files: Path) -> None:
    seen = _opens(counts, *files)
    assert all(0 < n <= LIMIT for n in seen.values()), seen


def test_convert_opens_its_input_once(tiny2_file, tmp_path, capsys, count_opens):
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "out")
    assert run.code == 0, run.err
    _check(count_opens, tiny2_file)


def test_an_svdquant_convert_and_inspect_open_the_file_once(tmp_path, capsys, count_opens):
    sf = pytest.importorskip("tests.svdqfiles", reason="deepcompressor-toolkit (the SVDQuant oracle) is installed "
                                                      "with --no-deps by .ci/run")
    fixture = sf.write_svdq_file(tmp_path / "svdq", "flux2", "int4")
    file = fixture.files[0]
    count_opens.clear()
    run = run_port(capsys, "inspect", file)
    assert run.code == 0, run.err
    _check(count_opens, file)
    count_opens.clear()
    run = run_port(capsys, "convert", file, "--out", tmp_path / "bf16")
    assert run.code == 0, run.err
    _check(count_opens, file)


def test_a_gguf_convert_opens_the_file_a_bounded_number_of_times(tiny2_state, tmp_path, capsys, count_opens):
    pytest.importorskip("gguf", reason="the quant extra (gguf) is in the test extra")
    file = tmp_path / "q8.gguf"
    qf.gguf_file(file, tiny2_state, "Q8_0")
    count_opens.clear()
    run = run_port(capsys, "convert", file, "--out", tmp_path / "out")
    assert run.code == 0, run.err
    _check(count_opens, file)


def test_merge_opens_base_and_adapter_once_each(tiny2_file, tiny2_state, tmp_path, capsys, count_opens):
    adapter, _ = adapter_for(tmp_path / "style.safetensors", BY_NAME["kohya"], tiny2_state, seed=1)
    count_opens.clear()
    run = run_port(capsys, "merge", tiny2_file, adapter, "--out", tmp_path / "merged")
    assert run.code == 0, run.err
    _check(count_opens, tiny2_file, adapter)


def test_the_counter_sees_a_reopen(tmp_path, count_opens):
    f = tmp_path / "x.bin"
    f.write_bytes(b"1")
    for _ in range(4):
        with open(f, "rb"):
            pass
    with pytest.raises(AssertionError):
        _check(count_opens, f)
