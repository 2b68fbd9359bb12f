"""convert and validate find a recipe's files in the workspace that `port fetch` fills."""

from __future__ import annotations

import json

import pytest

from porting.cli.app import main
from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint
from porting.demo.tinypipe import build_demo_base
from porting.inputs import open_source
from porting.reports import latest_report
from porting.tensors.identity import hash_checkpoint


def _run(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def test_convert_validate_publish_by_recipe_name(tmp_path, capsys):
    ws = tmp_path / "ports"
    build_demo_base(ws / "my-port" / "base")
    write_random_checkpoint(ws / "my-port" / "finetune" / "ft.safetensors", TINY_FLUX2, seed=5)
    assert _run(["convert", "my-port", "--workspace", str(ws), "--quiet"]) == 0
    assert (ws / "my-port" / "transformer" / "config.json").is_file()
    assert _run(["validate", "my-port", "--workspace", str(ws), "--resolution", "64", "--text-len", "32",
                 "--timesteps", "0.5", "--prompt", "a fox", "--quiet"]) == 0
    report = json.loads(latest_report(ws / "my-port" / "reports").read_text())  # reports/validate/<time>/
    assert report["verdict"] == "pass" and report["inputs"]["prompt"] == "a fox"
    record = json.loads((ws / "my-port" / "port.json").read_text())
    transformer = ws / "my-port" / "transformer"  # convert leaves the identity to validate, which names these files
    assert record["convert"]["weights_sha256"] is None
    assert record["validate"]["weights_sha256"] == hash_checkpoint(open_source(transformer).view)
    assert _run(["publish", "my-port", "--workspace", str(ws), "--quiet"]) == 0
    assert (ws / "my-port" / "published" / "model_index.json").is_file()


def test_recipe_without_finetune_says_fetch_first(tmp_path, capsys):
    (tmp_path / "ports" / "empty").mkdir(parents=True)
    assert _run(["convert", "empty", "--workspace", str(tmp_path / "ports")]) == 2
    assert "port fetch empty" in capsys.readouterr().err
