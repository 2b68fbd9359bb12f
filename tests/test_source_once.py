"""A checkpoint given to a verb is read once: one header read per file, whatever the verb asks of it.

The CLI opens each argument once (`porting.inputs.open_source`) and hands the opened `Source` down: the adapter
sniff, the quantized-layout decode, detection, the plan, placement and writing all see that one reading.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from porting.tensors import checkpoint

from .helpers import TINY2, reference_model, run_port, save_state
from .lorakit import NAMINGS, adapter_for


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("source-once")
    state = {k: v.bfloat16() for k, v in reference_model(TINY2, seed=5).state_dict().items()}
    base = save_state(root / "base.safetensors", state)
    lora, _ = adapter_for(root / "lora.safetensors", NAMINGS[0], state)
    return {"root": root, "base": base, "lora": Path(lora)}


@pytest.fixture
def reads(monkeypatch):
    """Header reads per file name, counted at `read_header` (every container reader's safetensors entry)."""
    counts: Counter[str] = Counter()
    real = checkpoint.read_header

    def counted(path):
        counts[Path(path).name] += 1
        return real(path)

    monkeypatch.setattr(checkpoint, "read_header", counted)
    return counts


def test_convert_reads_the_header_once(files, reads, capsys, tmp_path):
    run = run_port(capsys, "convert", files["base"], "--out", tmp_path / "out", "--json")
    assert run.code == 0, run.err
    assert reads == {"base.safetensors": 1}


def test_convert_dry_run_reads_the_header_once(files, reads, capsys):
    run = run_port(capsys, "convert", files["base"], "--dry-run", "--json")
    assert run.code == 0, run.err
    assert reads == {"base.safetensors": 1}


def test_convert_adapter_reads_the_header_once(files, reads, capsys, tmp_path):
    run = run_port(capsys, "convert", files["lora"], "--out", tmp_path / "out", "--json")
    assert run.code == 0, run.err
    assert reads == {"lora.safetensors": 1}


def test_inspect_reads_the_header_once(files, reads, capsys):
    run = run_port(capsys, "inspect", files["base"], "--json")
    assert run.code == 0, run.err
    assert reads == {"base.safetensors": 1}


def test_inspect_adapter_with_base_reads_each_header_once(files, reads, capsys):
    run = run_port(capsys, "inspect", files["lora"], "--base", files["base"], "--json")
    assert run.code == 0, run.err
    assert "effect" in json.loads(run.out)
    assert reads == {"lora.safetensors": 1, "base.safetensors": 1}


def test_merge_reads_each_header_once(files, reads, capsys, tmp_path):
    run = run_port(capsys, "merge", files["base"], files["lora"], "--out", tmp_path / "merged", "--json")
    assert run.code == 0, run.err
    assert reads == {"lora.safetensors": 1, "base.safetensors": 1}
