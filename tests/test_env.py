"""`port --version` and `port env`: what a bug report needs, as a table and as one JSON document."""

from __future__ import annotations

import json

import porting

from .helpers import run_port


def test_version_prints_the_version_and_exits_0(capsys) -> None:
    run = run_port(capsys, "--version")
    assert run.code == 0 and run.out.strip() == f"flux-port {porting.__version__}" and run.err == ""


def test_env_json_names_versions_builds_extras_devices_and_folders(capsys, tmp_path, monkeypatch) -> None:
    import torch

    monkeypatch.setenv("FLUX_PORT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FLUX_PORT_HOME", str(tmp_path / "ws"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    run = run_port(capsys, "env", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["flux_port"] == porting.__version__
    assert doc["packages"]["torch"] == torch.__version__
    assert doc["cuda_build"] == torch.version.cuda
    for name in ("diffusers", "transformers", "onnxruntime", "torch_npu"):
        assert name in doc["packages"]
    assert set(doc["extras"]) == {"metrics", "quant", "onnx", "lora", "ray", "charts", "npu"}
    assert doc["extras"]["onnx"] is True  # the test extra installs it
    assert doc["devices"][0]["device"] == "cpu"
    assert doc["visible_devices_env"] == {"CUDA_VISIBLE_DEVICES": ""}
    assert doc["folders"]["state"] == str(tmp_path / "state")
    assert doc["folders"]["workspace"] == str(tmp_path / "ws")


def test_env_table_fits_80_columns(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    run = run_port(capsys, "env")
    assert run.code == 0, run.err
    assert f"flux-port {porting.__version__}".split()[1] in run.out and "extras installed" in run.out
