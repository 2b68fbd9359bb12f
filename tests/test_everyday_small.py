"""Issue 21, items 7 and 10: the small things a new user trips over, and exit codes and messages that are true.

Each case runs the real CLI (`run_port`, or `python -m porting` in a subprocess for SIGTERM) on tiny real models
and asserts the exit code, the message and that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from porting.pipeline.publish import publish

from .helpers import REAL2, leftovers, meta_shapes, mount_tmpfs, run_port, save_state, write_header_only
from .test_safety import assert_clean_refusal

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def published(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small") / "published"
    publish(port["base"], port["transformer"], out, report=port["pass"])
    return out


def _beside(path: Path) -> list[str]:
    """Everything in the folder holding `path` (staging and trash folders included, whatever their names)."""
    return sorted(p.name for p in path.parent.iterdir())


# --- 7. small things ---------------------------------------------------------------------------------------------

def test_quantize_summary_shows_the_file_hash_not_none(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    run = run_port(capsys, "convert", tiny2_file, "--to", "original", "--quantize", "fp8-scaled",
                   "--out", tmp_path / "q")
    assert run.code == 0, run.err
    assert "None" not in run.out and "file sha256" in run.out
    doc = json.loads((tmp_path / "q" / "flux-port.json").read_text())
    import hashlib

    assert doc["file_sha256"] == hashlib.sha256((tmp_path / "q" / doc["file"]).read_bytes()).hexdigest()
    assert doc["file_sha256"] in " ".join(run.out.split())


def test_errors_are_shown_with_significant_digits() -> None:
    from validation.report import _pct, _ratio

    assert _pct(0.0000041) == "0.00041 %" and _pct(0.123) == "12.3 %" and _pct(0.0) == "0 %"
    assert _ratio(0.07) == "0.07" and _ratio(0.0012) == "0.0012" and _ratio(1.0) == "1.00"


def test_validate_report_never_shows_an_error_as_zero(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    run = run_port(capsys, "validate", tiny2_file, "--out", tmp_path / "r", "--resolution", "32", "--text-len", "8",
                   "--timesteps", "0.5", "--dtype", "fp16", "--intrinsic", "native")
    assert run.code in (0, 1), run.err
    md = (tmp_path / "r" / "report.md").read_text()
    assert "0.000 %" not in md and "0.000 %" not in run.out


def test_demo_refusal_names_workdir(capsys, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    run = run_port(capsys, "demo", "--workdir", work)
    assert_clean_refusal(run, 2, "--workdir")
    assert "--out" not in run.msg and (work / "notes.txt").read_text() == "mine"


def _interrupt_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from porting.pipeline import pipeload

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeload, "load", interrupted)


def test_interrupted_compare_says_what_it_removed_and_leaves_no_empty_reports(capsys, monkeypatch, published: Path,
                                                                             tmp_path: Path) -> None:
    _interrupt_loading(monkeypatch)
    out = tmp_path / "reports" / "compare" / "run"
    run = run_port(capsys, "compare", published, published, "--steps", "1", "--size", "32", "--out", out)
    assert run.code == 130 and "Traceback" not in run.err
    assert "no report of this run was written" in run.msg and "fetch" not in run.msg
    assert sorted(os.listdir(tmp_path)) == []  # reports/ and reports/compare/ were made by this run: gone again


def test_interrupted_compare_keeps_a_reports_folder_it_did_not_make(capsys, monkeypatch, published: Path,
                                                                    tmp_path: Path) -> None:
    _interrupt_loading(monkeypatch)
    (tmp_path / "reports").mkdir()
    run = run_port(capsys, "compare", published, published, "--steps", "1", "--size", "32",
                   "--out", tmp_path / "reports" / "compare" / "run")
    assert run.code == 130
    assert os.listdir(tmp_path) == ["reports"] and os.listdir(tmp_path / "reports") == []


def test_interrupted_bench_message_is_its_own(capsys, monkeypatch, published: Path, tmp_path: Path) -> None:
    _interrupt_loading(monkeypatch)
    run = run_port(capsys, "bench", published, "--steps", "1", "--size", "32", "--out", tmp_path / "b")
    assert run.code == 130 and "Traceback" not in run.err
    assert "no report of this run was written" in run.msg and "fetch" not in run.msg
    assert os.listdir(tmp_path) == []


def test_failed_run_removes_the_parent_folders_it_made(capsys, monkeypatch, tmp_path: Path,
                                                       tiny2_file: Path) -> None:
    import porting.engine.convert as engine

    def interrupted(folder, *args, **kwargs):
        (Path(folder) / "diffusion_pytorch_model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "write_shards", interrupted)
    (tmp_path / "mine").mkdir()
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "mine" / "new" / "deeper" / "out")
    assert run.code == 130 and "the output being written was removed" in run.msg
    assert os.listdir(tmp_path) == ["mine"] and os.listdir(tmp_path / "mine") == []


def test_model_card_uses_dtype_and_names_no_fake_base(capsys, port: dict, tmp_path: Path) -> None:
    out = tmp_path / "pub"
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"],
                   "--report", port["pass"], "--out", out)
    assert run.code == 0, run.err
    card = (out / "README.md").read_text()
    header = card.split("---", 2)[1]
    assert "base_model" not in header and "torch_dtype" not in card
    assert "from_pretrained(\"pub\", dtype=torch.bfloat16)" in card
    assert "--base-model" in run.msg
    assert json.loads((out / "manifest.json").read_text())["base_model"] is None
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"],
                   "--report", port["pass"], "--out", tmp_path / "pub2", "--base-model", "org/klein")
    assert run.code == 0, run.err
    assert 'base_model: "org/klein"' in (tmp_path / "pub2" / "README.md").read_text()


def test_every_report_value_in_the_model_card_is_escaped(capsys, port: dict, tmp_path: Path) -> None:
    from .tinyport import report_doc

    evil = "<img src=x onerror=alert(1)>[click](http://evil)"
    doc = report_doc(port["weights"])
    doc.update(device=f"cpu`{evil}", dtype=evil, golden_dtype=evil, reference=evil, tool=evil, version=evil,
               verdict="pass")
    doc["rule"]["statement"] = evil
    doc["summary"][0]["name"] = evil
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(json.dumps(doc))
    (tmp_path / "r" / "report.md").write_text("# report\n")
    out = tmp_path / "pub"
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"],
                   "--report", tmp_path / "r" / "report.json", "--out", out, "--base-model", "org/klein")
    assert run.code == 0, run.err
    card = (out / "README.md").read_text()
    section = card.split("## Validation", 1)[1].split("## Files", 1)[0]
    import re

    outside_code = re.sub(r"`[^`]*`", "", section)  # a code span shows its text literally
    assert not re.search(r"(?<!\\)<img|(?<!\\)\]\(http", outside_code)  # only escaped ones
    assert "\\<img src=x onerror=alert\\(1\\)\\>\\[click\\]\\(http://evil\\)" in section
    assert "`cpu'<img src=x onerror=alert(1)>[click](http://evil)`" in section  # inside a code span: inert


def test_compare_and_bench_values_in_the_card_are_escaped(port: dict) -> None:
    from porting.pipeline.cardtables import _escaped

    doc = _escaped({"device": "<b>x</b>", "rows": [{"task": "[a](b)"}], "n": 3, "f": 0.5})
    assert doc == {"device": "\\<b\\>x\\</b\\>", "rows": [{"task": "\\[a\\]\\(b\\)"}], "n": 3, "f": 0.5}


def test_a_lora_converted_to_kohya_is_named_for_kohya(capsys, tmp_path: Path) -> None:
    from porting.demo.tiny import TINY_FLUX2, model_shapes

    from .lorakit import BY_NAME, make_parts, write_adapter

    shapes = {k[: -len(".weight")]: tuple(s) for k, s in model_shapes(TINY_FLUX2).items() if k.endswith(".weight")}
    parts = make_parts(shapes, ["double_blocks.0.img_attn.qkv"], "lora", seed=0, alpha=1.0)
    src = write_adapter(tmp_path / "style-kohya.safetensors", BY_NAME["kohya"], parts)
    assert run_port(capsys, "convert", src, "--out", tmp_path / "diffusers", "-q").code == 0
    diffusers_file = tmp_path / "diffusers" / "pytorch_lora_weights.safetensors"
    assert diffusers_file.is_file()
    for style in ("kohya", "bfl"):
        run = run_port(capsys, "convert", diffusers_file, "--to", "original", "--lora-style", style,
                       "--out", tmp_path / style, "-q")
        assert run.code == 0, run.err
        names = sorted(p.name for p in (tmp_path / style).iterdir() if p.suffix == ".safetensors")
        assert names == [f"pytorch_lora_weights_{style}.safetensors"]
        manifest = json.loads((tmp_path / style / "flux-port-adapter.json").read_text())
        assert manifest["file"] == names[0]


# --- 10. exit codes and messages that are true --------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 64 KiB filesystem (tmpfs): smaller than a Q8_0 file of the tiny model; needs root (CI has it)."""
    yield from mount_tmpfs(tmp_path / "tiny-disk", "64k")


def test_a_full_disk_during_gguf_quantize_is_exit_5_naming_the_path(capsys, tiny_disk: Path,
                                                                    tiny2_file: Path) -> None:
    pytest.importorskip("gguf")
    (tiny_disk / "keep.txt").write_text("mine")
    out = tiny_disk / "gguf"
    run = run_port(capsys, "convert", tiny2_file, "--to", "original", "--quantize", "gguf-q8_0", "--out", out)
    assert_clean_refusal(run, 5, str(out), "the disk is full", "the partial output was removed")
    assert "requested and" not in run.msg
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["keep.txt"]


def _port_process(*argv: str | Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "porting", *map(str, argv)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_cleans_up_like_ctrl_c_and_says_so(tmp_path: Path) -> None:
    # klein-4B's geometry as a sparse file: 8 GB of (zero) weights, minutes of writing, next to no disk
    src = write_header_only(tmp_path / "klein-4b.safetensors", meta_shapes(REAL2["klein-4B"]))
    out = tmp_path / "out"
    proc = _port_process("convert", src, "--out", out)
    try:
        deadline = time.monotonic() + 120
        while not any(n.startswith(".out.partial-") for n in os.listdir(tmp_path)):  # bounded poll, no sleep-sync
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the staging folder never appeared"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr
    message = " ".join(stderr.split())
    assert "Terminated (SIGTERM): the output being written was removed" in message and "Traceback" not in stderr
    assert sorted(os.listdir(tmp_path)) == ["klein-4b.safetensors"]


def test_the_cli_gives_the_sigterm_handler_back(capsys, tiny2_file: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert run_port(capsys, "inspect", tiny2_file).code == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_demo_ctrl_c_says_what_it_left(capsys, monkeypatch, tmp_path: Path) -> None:
    import porting.engine.convert as engine

    def interrupted(src, out, *args, **kwargs):
        Path(out).mkdir()
        (Path(out) / "half.safetensors").write_bytes(b"half")  # even a step that wrote in place is taken back
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "convert", interrupted)
    work = tmp_path / "work"
    run = run_port(capsys, "demo", "--workdir", work)
    assert run.code == 130 and "Traceback" not in run.err
    assert "the demo stopped while writing transformer, whose partial output was removed" in run.msg
    assert f"{work} keeps what the finished steps wrote (base, finetune)" in run.msg
    assert "nothing at the destination changed" not in run.msg
    assert sorted(p.name for p in work.iterdir()) == [".flux-port-output.json", "base", "finetune"]
    from porting.cli.demo_cmd import prepare_workdir

    prepare_workdir(work)  # the next demo reuses the folder (nothing in it is foreign)
    assert sorted(p.name for p in work.iterdir()) == [".flux-port-output.json"]


@pytest.mark.parametrize("length", [250, 255])
def test_an_out_name_of_up_to_255_bytes_works(capsys, tmp_path: Path, tiny2_file: Path, length: int) -> None:
    out = tmp_path / ("m" * length)
    run = run_port(capsys, "convert", tiny2_file, "--out", out, "-q")
    assert run.code == 0, run.err
    assert _beside(out) == [out.name] and (out / "diffusion_pytorch_model.safetensors").is_file()
    run = run_port(capsys, "convert", tiny2_file, "--out", out, "--force", "-q")  # the trash folder too
    assert run.code == 0, run.err
    assert _beside(out) == [out.name]


def test_a_generate_output_name_of_255_bytes_works(capsys, published: Path, tmp_path: Path) -> None:
    output = tmp_path / ("i" * 251 + ".png")
    run = run_port(capsys, "generate", published, "--prompt", "a fox", "--steps", "1", "--size", "32",
                   "--output", output)
    assert run.code == 0, run.err
    assert _beside(output) == [output.name]


def test_leftovers_of_a_long_out_name_are_still_found(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    from porting.outputs import _staging_prefix
    from porting.ownership import write_staging_marker

    out = tmp_path / ("é" * 127)  # 254 bytes
    dead = Path(tempfile.mkdtemp(prefix=_staging_prefix(out), dir=tmp_path))  # a killed run's staging folder
    write_staging_marker(dead)
    assert len(os.fsencode(dead.name)) <= 255
    alike = tmp_path / (_staging_prefix(out) + "mine")  # named alike, not flux-port's: left alone
    alike.mkdir()
    run = run_port(capsys, "convert", tiny2_file, "--out", out)
    assert run.code == 0, run.err
    assert f"removed {dead.name}" in run.msg
    assert _beside(out) == sorted([out.name, alike.name])


def test_a_path_with_an_emoji_code_is_printed_as_it_is(capsys, tmp_path: Path, tiny2_file: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the path whole on one line of the table (80 columns would fold it)
    out = tmp_path / "model:smile:"
    run = run_port(capsys, "convert", tiny2_file, "--out", out)
    assert run.code == 0, run.err
    assert "model:smile:" in run.out and "\U0001f604" not in run.out + run.err
    run = run_port(capsys, "convert", tiny2_file, "--out", out)
    assert run.code == 2 and "model:smile:" in run.err and "\U0001f604" not in run.err


def test_dry_run_quantize_prints_the_plan(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    run = run_port(capsys, "convert", tiny2_file, "--to", "original", "--quantize", "gguf-q8_0", "--dry-run")
    assert run.code == 0, run.err
    assert "model-Q8_0.gguf" in run.out and "nothing written" in run.out
    run = run_port(capsys, "convert", tiny2_file, "--to", "original", "--quantize", "fp8-scaled", "--dry-run",
                   "--json")
    assert run.code == 0 and json.loads(run.out)["planned_files"] == ["model-fp8-scaled.safetensors"]
    assert os.listdir(tmp_path) == []


def test_quantize_without_original_naming_is_refused_for_that_reason(capsys, tmp_path: Path,
                                                                     tiny2_file: Path) -> None:
    run = run_port(capsys, "convert", tiny2_file, "--quantize", "fp8-scaled", "--dry-run")
    assert_clean_refusal(run, 2, "needs --to original", "--dry-run")
    assert "--out DIR" not in run.msg


def test_newlines_and_bidi_controls_in_tensor_names_are_escaped(capsys, tmp_path: Path, tiny2_state) -> None:
    evil = "double_blocks.0.evil\nweight\u202etxt.exe\u2066"
    src = save_state(tmp_path / "evil.safetensors", {**tiny2_state, evil: tiny2_state["img_in.weight"].clone()},
                     torch.bfloat16)
    run = run_port(capsys, "convert", src, "--out", tmp_path / "out")
    assert run.code == 1, run.err
    assert "\u202e" not in run.err and "\u2066" not in run.err
    assert "double_blocks.0.evil\\x0aweight\\u202etxt.exe\\u2066" in run.err
    assert leftovers(tmp_path / "out") == []


def test_printable_escapes_every_format_control() -> None:
    from porting.text import printable

    for ch in "\x1b\x07\x85\u061c\u200b\u200e\u200f\u2028\u2029\u202a\u202e\u2066\u2069\ufeff":
        assert ch not in printable(f"a{ch}b", lines=False) and ch not in printable(f"a{ch}b")
    assert printable("a\nb") == "a\nb" and printable("a\nb", lines=False) == "a\\x0ab"


def test_adapter_manifest_values_in_the_card_are_escaped(tmp_path: Path) -> None:
    import ast
    import re

    from porting.adapters.publishing import card_section

    evil = "<img src=x>[a](http://evil)`|"
    card = card_section('my "repo"', [{"folder": str(tmp_path / "style"), "format": evil, "source": f"/x/{evil}",
                                       "kinds": {evil: 2}, "sha256": evil}])
    table = card.split("```python", 1)[0]
    assert not re.search(r"(?<!\\)<img|(?<!\\)\]\(http", re.sub(r"`[^`]*`", "", table))
    assert all(line.count("|") - line.count("\\|") == 5 for line in table.splitlines() if line.startswith("| `"))
    ast.parse(card.split("```python\n", 1)[1].split("```", 1)[0])  # the snippet stays valid Python
