"""`port demo`: the README's main job walks the whole path offline and leaves a loadable pipeline and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from porting.cli.app import main
from porting.ownership import RECORD, RECORD_VERSION, foreign_entries
from porting.reports import latest_report

from .helpers import run_port


def test_demo_walks_the_whole_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "demo-out" / "klein"  # the default family's default folder
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--json"])
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


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (the ownership records aside: a rerun rewrites them)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != RECORD}


@pytest.mark.slow  # two demos or more, 10 s each; test_demo_folder.py tests this with small fake steps
def test_a_second_family_goes_to_its_own_folder_and_keeps_the_users_reports(tmp_path, capsys, monkeypatch):
    """`port demo` then `port demo --family flux1` in the same folder (issue 30, item 1): each family writes
    demo-out/FAMILY/; the reports a verb the user ran wrote in the first one are kept byte for byte."""
    monkeypatch.chdir(tmp_path)
    assert run_port(capsys, "demo").code == 0
    klein = tmp_path / "demo-out" / "klein"
    assert (klein / "published" / "model_index.json").is_file()
    run = run_port(capsys, "validate", klein / "transformer", "--base", klein / "base", "--resolution", "64",
                   "--text-len", "32")
    assert run.code == 0, run.msg
    before = _files(klein)
    users = [p for p in (klein / "reports" / "validate").iterdir()]
    assert len(users) == 2  # the demo's and the user's
    run = run_port(capsys, "demo", "--family", "flux1")
    assert run.code == 0, run.msg
    assert "demo-out/flux1/published" in run.out
    assert "(relative L2 distance from the float32 output)" in run.out and "up to 2.0x passes" in run.out
    assert _files(klein) == before  # the first family's folder, the user's report in it, byte for byte
    assert (tmp_path / "demo-out" / "flux1" / "demo.png").is_file()


@pytest.mark.slow  # two demos or more, 10 s each; test_demo_folder.py tests this with small fake steps
def test_a_rerun_in_the_same_folder_replaces_the_demos_files_and_keeps_what_other_verbs_wrote(tmp_path, capsys):
    work = tmp_path / "work"
    assert run_port(capsys, "demo", "--workdir", work).code == 0
    demo_report = latest_report(work / "reports")
    run = run_port(capsys, "validate", work / "transformer", "--base", work / "base", "--resolution", "64",
                   "--text-len", "32")
    assert run.code == 0, run.msg
    user_report = latest_report(work / "reports").parent
    assert user_report != demo_report.parent
    assert run_port(capsys, "convert", work / "finetune" / "tiny-klein-finetune.safetensors",
                    "--out", work / "mine").code == 0  # another verb's --out inside the work folder
    run = run_port(capsys, "generate", work / "published", "-p", "a fox", "-o", work / "fox.png", "--quiet")
    assert run.code == 0, run.msg  # an image of the user's, beside the demo's own
    kept = {name: _files(folder) for name, folder in (("report", user_report), ("mine", work / "mine"))}
    image = (work / "fox.png").read_bytes()
    run = run_port(capsys, "demo", "--workdir", work)
    assert run.code == 0, run.msg
    assert {name: _files(folder) for name, folder in (("report", user_report), ("mine", work / "mine"))} == kept
    assert (work / "fox.png").read_bytes() == image
    runs = sorted(p.name for p in (work / "reports" / "validate").iterdir())
    assert len(runs) == 2 and user_report.name in runs  # the earlier demo's own report was replaced by this one's
    assert foreign_entries(work) == ["fox.png"]  # the folder stays reusable: the image is beside the demo's entries
    assert run_port(capsys, "demo", "--workdir", work).code == 0  # and reruns again
    assert _files(user_report) == kept["report"]


@pytest.mark.slow  # two demos or more, 10 s each; test_demo_folder.py tests this with small fake steps
def test_a_rerun_refuses_when_another_verb_wrote_inside_what_the_demo_replaces(tmp_path, capsys):
    work = tmp_path / "work"
    assert run_port(capsys, "demo", "--workdir", work).code == 0
    run = run_port(capsys, "validate", work / "published" / "transformer", "--base", work / "base",
                   "--resolution", "64", "--text-len", "32")
    assert run.code == 0, run.msg
    assert (work / "published" / "reports" / "validate").is_dir()
    before = _files(work)
    run = run_port(capsys, "demo", "--workdir", work)
    assert run.code == 2 and run.out == ""
    assert "a new demo would replace published" in run.msg and "published/reports" in run.msg
    assert "nothing was changed" in run.msg and "--workdir OTHER" in run.msg
    assert _files(work) == before


def test_the_validate_line_says_what_the_error_is_relative_to_and_why_it_passes() -> None:
    """Issue 30, item 9: FLUX.1's tiny demo prints an output error of 33 %; the line says it is the distance from the
    float32 output, that bf16 itself costs as much on this model, and that the verdict is the ratio."""
    from porting.cli.demo_cmd import validate_line

    def doc(device: float, intrinsic: float) -> dict:
        return {"verdict": "pass", "intrinsic": "emulated", "rule": {"max_ratio": 2.0},
                "output": {"device": {"rel_l2": device}, "intrinsic": {"rel_l2": intrinsic},
                           "ratio": device / intrinsic},
                "blocks": [{"teacher_forced": {"ratio": 1.22}}]}

    line = validate_line(doc(0.332, 0.3318), Path("r/report.md"))
    assert "PASS" in line and "output error 33.2 % (relative L2 distance from the float32 output)" in line
    assert "bf16 itself costs 33.2 % on this model (rounding emulated in float32)" in line
    assert "the port's error is 1.00x bf16's own; up to 2.0x passes" in line
    assert "large on this tiny random-weight model: the verdict is the ratio" in line
    small = validate_line(doc(0.00602, 0.0048), Path("r/report.md"))
    assert "1.25x bf16's own" in small and "random-weight" not in small
    assert all(len(x) <= 80 for x in small.splitlines()[:-1])


@pytest.mark.slow  # the whole demo plus the LoRA steps: about 15 s on two cores
def test_demo_lora_makes_inspects_merges_and_validates_a_lora(tmp_path, capsys):
    """Issue 30, item 7: `port demo --lora` makes a tiny LoRA for the tiny port, measures its effect on each module,
    merges it and validates the merge; the merged weights are the port's plus B @ A (the test's own arithmetic)."""
    import torch
    from safetensors.torch import load_file

    work = tmp_path / "demo"
    run = run_port(capsys, "demo", "--workdir", work, "--lora")
    assert run.code == 0, run.msg
    assert "[9/9] validate (merged) on cpu" in run.out and "[6/9] generate" in run.out
    assert all(len(line) <= 80 for line in run.out.splitlines() if str(work) not in line)  # paths are the user's
    run = run_port(capsys, "demo", "--workdir", work, "--lora", "--json")  # a rerun replaces its own LoRA steps
    assert run.code == 0, run.msg
    doc = json.loads(run.out)
    counts = doc["lora"]["effect"]["counts"]
    assert counts["modules"] == counts["ok"] > 0 and counts["unplaced"] == 0
    assert doc["merge"]["ok"] and doc["validate_merged"]["verdict"] == "pass"
    assert doc["validate_merged"]["weights_sha256"] != doc["validate"]["weights_sha256"]
    manifest = json.loads((work / "merged" / "flux-port.json").read_text())
    assert manifest["merged_adapters"][0]["modules"] == counts["modules"]
    lora = load_file(str(work / "lora" / "tiny-lora.safetensors"))
    port = {k: v for f in sorted((work / "transformer").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    merged = {k: v for f in sorted((work / "merged").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    key = "transformer_blocks.0.attn.to_q"
    expected = port[f"{key}.weight"].float() + lora[f"transformer.{key}.lora_B.weight"].float() @ \
        lora[f"transformer.{key}.lora_A.weight"].float()
    assert merged[f"{key}.weight"].dtype == port[f"{key}.weight"].dtype
    torch.testing.assert_close(merged[f"{key}.weight"].float(), expected.to(merged[f"{key}.weight"].dtype).float())
    assert not torch.equal(merged[f"{key}.weight"], port[f"{key}.weight"])
    assert foreign_entries(work) == []
