"""An export records the identity of every component it uses, and generate, validate and compare refuse it once one
changed: the demo rerun that put FLUX.2 [dev]'s text encoder and VAE in the source folder of a klein export.

The identity itself (`porting/export/identity.py`) is checked on real files: rewriting the same bytes keeps it, a
change in a large file's sampled ends changes it, a file gone is named.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import build_tiny_port  # noqa: E402

from porting.demo.bases import write_tiny_base  # noqa: E402
from porting.errors import InputError  # noqa: E402
from porting.export import identity  # noqa: E402
from porting.export.onnx import MANIFEST  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from tests.helpers import run_cli  # noqa: E402


def _weights(path: Path, rows: int, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"a.weight": torch.randn(rows, 64, generator=g), "b.weight": torch.randn(rows, 64, generator=g)},
              str(path))
    return path


def test_identity_is_content_not_file_times(tmp_path) -> None:
    folder = tmp_path / "vae"
    _weights(folder / "model.safetensors", 16)
    (folder / "config.json").write_text('{"a": 1}')
    before = identity.identity(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(data)  # the same bytes written again (a demo rerun, cp without -p)
    os.utime(folder / "config.json", ns=(1, 1))
    assert identity.identity(folder) == before
    (folder / "config.json").write_text('{"a": 2}')
    assert identity.identity(folder) != before
    assert identity.identity(tmp_path / "gone") == identity.GONE


def test_a_large_file_is_identified_by_its_size_header_and_ends(tmp_path) -> None:
    big = _weights(tmp_path / "te" / "model.safetensors", 16 * 1024)  # 8 MiB: sampled, not read whole
    assert big.stat().st_size > 2 * identity.SAMPLE
    before = identity.identity(big.parent)
    with big.open("r+b") as f:  # the last MiB: another model's tensors at the same offsets
        f.seek(-100, 2)
        f.write(b"\x01" * 100)
    assert identity.identity(big.parent) != before
    _weights(big, 16 * 1024, seed=1)  # a retrained model of the same shapes: header equal, data not
    assert identity.identity(big.parent) not in (before, identity.identity(big.parent.parent / "none"))


def test_a_manifest_without_identities_is_refused_saying_to_export_again(tmp_path) -> None:
    with pytest.raises(InputError, match="records no component identities") as err:
        identity.check(tmp_path, {"source": {}, "components": {}})
    assert "Export again" in (err.value.hint or "")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A klein export, then the source folder's text encoder and VAE replaced by FLUX.2 [dev]'s (what a demo rerun
    with another family did to the folder the export borrows from)."""
    from porting.export.onnx import export_onnx

    port = build_tiny_port(tmp_path_factory.getbasetemp() / "tiny-port")
    root = tmp_path_factory.mktemp("mixed")
    folder = root / "klein"
    publish(port["base"], port["transformer"], folder, report=port["pass"])
    out = root / "klein-onnx"
    export_onnx(folder, out, dtype="fp32", components=["transformer"])
    manifest = json.loads((out / MANIFEST).read_text())
    recorded = manifest["identities"]
    assert set(recorded["source"]) >= {"model_index.json", "text_encoder", "tokenizer", "transformer", "vae",
                                       "scheduler"}
    assert set(recorded["export"]) >= {"transformer", "tokenizer", "scheduler"}
    identity.check(out, manifest)  # as exported: nothing changed
    from validation.image_compare import Side, compare

    same = compare(Side(folder), Side(out), prompts=["a fox"], steps=1, out=root / "cmp")  # the export runs as is
    dev = write_tiny_base(root / "dev-base", "dev", seed=3)  # seed 0 would build klein's very VAE
    for name in ("text_encoder", "vae"):
        shutil.rmtree(folder / name)
        shutil.copytree(dev / name, folder / name)
    return {"folder": folder, "out": out, "recorded": recorded, "same": same.doc}


def _assert_refused(code: int, err: str, mixed: dict) -> None:
    assert code == 2, err
    flat = " ".join(err.split())
    for name in ("text_encoder", "vae"):
        recorded = mixed["recorded"]["source"][name]["identity"]
        now = identity.identity(mixed["folder"] / name)
        assert f"the source folder's {name} (" in flat and recorded[:16] in flat and now[:16] in flat, err
    assert "mix two models" in flat and "Traceback" not in err


@pytest.mark.slow  # one transformer-only ONNX export of the tiny klein (about 30 s on two cores)
def test_compare_runs_an_unchanged_export_as_a_side(mixed) -> None:
    doc = mixed["same"]
    cand = doc["candidate"]
    assert cand["runtime"] == "onnxruntime:CPUExecutionProvider" and cand["export_source"] == str(mixed["folder"])
    assert cand["weights_sha256"] == doc["reference"]["weights_sha256"]  # the weights the graph was made from
    assert doc["summary"]["psnr"]["mean"] > 40  # an fp32 export of the same weights draws the same image


@pytest.mark.slow  # one transformer-only ONNX export of the tiny klein (about 30 s on two cores)
def test_generate_refuses_the_mixed_export(mixed, tmp_path, capsys) -> None:
    code, _, err = run_cli(["generate", str(mixed["out"]), "--prompt", "a fox", "--steps", "1",
                            "--output", str(tmp_path / "x.png")], capsys)
    _assert_refused(code, err, mixed)
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow  # one transformer-only ONNX export of the tiny klein (about 30 s on two cores)
def test_validate_refuses_the_mixed_export(mixed, tmp_path, capsys) -> None:
    code, _, err = run_cli(["validate", str(mixed["out"] / "transformer"), "--runtime", "onnxruntime",
                            "--out", str(tmp_path / "v")], capsys)
    _assert_refused(code, err, mixed)
    assert not (tmp_path / "v").exists()


@pytest.mark.slow  # one transformer-only ONNX export of the tiny klein (about 30 s on two cores)
@pytest.mark.parametrize("side", ["reference", "candidate"])
def test_compare_refuses_the_mixed_export_on_either_side(mixed, tmp_path, capsys, side) -> None:
    other = mixed["folder"]
    pair = [str(mixed["out"]), str(other)] if side == "reference" else [str(other), str(mixed["out"])]
    code, _, err = run_cli(["compare", *pair, "--prompt", "a fox", "--steps", "1", "--out", str(tmp_path / "c")],
                           capsys)
    _assert_refused(code, err, mixed)
    assert not (tmp_path / "c").exists()


def test_a_recorded_component_without_a_path_or_gone_is_named(tmp_path) -> None:
    part = tmp_path / "vae"
    part.mkdir()
    (part / "config.json").write_text("{}")
    manifest = {"identities": {"source": {"vae": {"path": str(part), "identity": identity.identity(part)},
                                          "text_encoder": {"path": "", "identity": "ab" * 32}},
                               "export": {}}}
    with pytest.raises(InputError, match=r"text_encoder \(\.?\) is gone") as err:
        identity.check(tmp_path, manifest)
    assert "vae" not in str(err.value)  # unchanged: not named
