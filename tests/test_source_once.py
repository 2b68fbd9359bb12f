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

from .helpers import TINY2, reference_model, run_port, save_state, write_raw_safetensors
from .lorakit import NAMINGS, adapter_for


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("source-once")
    state = {k: v.bfloat16() for k, v in reference_model(TINY2, seed=5).state_dict().items()}
    base = save_state(root / "base.safetensors", state)
    lora, _ = adapter_for(root / "lora.safetensors", NAMINGS[0], state)
    keys = sorted(state)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_state(root / "sharded" / name, {k: state[k] for k in part})
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}))
    return {"root": root, "base": base, "lora": Path(lora), "sharded": root / "sharded"}


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


def test_convert_of_a_sharded_folder_reads_each_shard_header_once(files, reads, capsys, tmp_path):
    run = run_port(capsys, "convert", files["sharded"], "--out", tmp_path / "out", "--json")
    assert run.code == 0, run.err
    assert reads == {"a.safetensors": 1, "b.safetensors": 1}


def test_a_file_that_cannot_be_opened_is_read_and_reported_once(reads, capsys, tmp_path):
    """The open that fails is the one open: its reason is the error (no sniff that swallows it and a second open
    that raises it again)."""
    bad = write_raw_safetensors(tmp_path / "bad.safetensors", {"x": {"dtype": "BF16", "shape": [4],
                                                                     "data_offsets": [0, 8]}}, b"\0" * 4)
    run = run_port(capsys, "convert", bad, "--out", tmp_path / "out", "--json")
    assert run.code == 2 and "file is truncated" in run.msg and run.msg.count("truncated") == 1
    assert reads == {"bad.safetensors": 1}


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


def test_a_source_is_what_its_header_says_and_is_passed_through(files):
    from porting.inputs import Source, as_source, open_source

    weights, adapter = open_source(files["base"]), open_source(files["lora"])
    assert (weights.kind, weights.family, weights.files) == ("weights", "flux2", (files["base"],))
    assert (adapter.kind, adapter.family) == ("adapter", "flux2") and adapter.adapter.modules
    assert set(weights.stamps) == {files["base"]} and weights.stamps[files["base"]][1] == files["base"].stat().st_size
    assert as_source(weights) is weights and as_source(weights, kind="weights") is weights
    assert isinstance(as_source(files["base"]), Source)
    assert weights.detect() is weights.detection  # once per source


def test_detect_against_a_base_config_uses_the_same_reading(files, reads):
    from porting.errors import ConfigMismatchError
    from porting.inputs import as_source, open_source

    source = open_source(files["base"])
    config = {**source.detection.config, "num_layers": 7}
    with pytest.raises(ConfigMismatchError, match="does not fit the base config"):
        as_source(source, base_config=config).detection
    assert source.detect().variant == source.detection.variant
    assert reads == {"base.safetensors": 1}


def test_a_source_replaced_after_it_was_opened_is_refused_at_the_end(files, tmp_path):
    """The stamps are taken as the header is read: a file replaced between the open and the write is noticed
    (stamps taken just before writing, as before, missed it), and nothing is written."""
    import os
    import shutil

    from porting.engine.convert import convert
    from porting.errors import InputError
    from porting.inputs import open_source

    copy = shutil.copy(files["base"], tmp_path / "copy.safetensors")
    source = open_source(copy)
    replacement = shutil.copy(files["base"], tmp_path / "replacement.safetensors")
    os.replace(replacement, copy)  # same bytes, another file
    with pytest.raises(InputError, match="the source changed while it was being converted"):
        convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_escaped_exception_past_the_open_names_the_source(files, capsys, monkeypatch, tmp_path):
    """A failure past the open still names the file that was read, not every existing path on the command line
    (the frames hold a `Source` where they held a path; the last-resort handler reads its path)."""
    from porting.engine import convert as engine

    def failing(*args, **kwargs):
        raise ValueError("odd value")

    monkeypatch.setattr(engine, "build_plan", failing)
    (tmp_path / "out").mkdir()  # an existing path on the command line: argv alone would not say which is read
    run = run_port(capsys, "convert", files["base"], "--out", tmp_path / "out", "--force", "--json")
    assert run.code == 2 and f"{files['base']}: cannot be read (ValueError: odd value)" in run.msg, run.msg
