"""`port demo`: the README's main job walks the whole path offline and leaves a loadable pipeline and a PNG."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from porting.cli.app import main
from porting.ownership import RECORD, RECORD_VERSION, foreign_entries
from porting.reports import latest_report


def test_demo_walks_the_whole_path(tmp_path, capsys):
    work = tmp_path / "demo"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--workdir", str(work), "--json"])
    assert exc.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["convert"]["ok"] and doc["convert"]["source_tensors"] == 41 and doc["convert"]["target_tensors"] == 49
    assert doc["validate"]["verdict"] == "pass"
    report_json = latest_report(work / "reports")  # reports/validate/<UTC time>/report.json since issue 21
    assert report_json is not None and report_json.parent.parent == work / "reports" / "validate"
    report = json.loads(report_json.read_text())
    assert report["intrinsic"] == "emulated"  # a CPU validation measures the CPU's bf16 kernels
    assert report["inputs"]["text_features"] == "prompt"  # the tiny base's own text encoder was used
    published = work / "published"
    assert json.loads((published / "model_index.json").read_text())["_class_name"] == "Flux2KleinPipeline"
    assert (published / "report.json").is_file() and (published / "README.md").is_file()
    with Image.open(work / "demo.png") as image:
        assert image.size == (64, 64)
    for written in (report_json, work / "transformer" / "flux-port.json",
                    published / "manifest.json"):
        assert json.loads(written.read_text())["format_version"] == 1, written  # every JSON the tool writes
    for record in (published / RECORD, work / RECORD):  # ownership records: per file since version 2
        assert json.loads(record.read_text())["format_version"] == RECORD_VERSION == 2, record
    assert foreign_entries(work) == []  # every file the demo wrote is on its work folder's record
