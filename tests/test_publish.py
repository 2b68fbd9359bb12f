"""port publish: a tiny port assembled, gated on its report, loaded by the real diffusers pipelines."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import in_memory_image, write_report  # noqa: E402

from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint  # noqa: E402
from porting.engine.convert import convert  # noqa: E402
from porting.errors import CheckFailed  # noqa: E402
from porting.outputs import RECORD  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from tests.helpers import run_cli  # noqa: E402


@pytest.fixture(scope="module")
def published(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pub") / "tiny-klein-ft"
    publish(port["base"], port["transformer"], out, report=port["pass"],
            base_model="black-forest-labs/FLUX.2-klein-4B")
    return out


def loaded_image(pipeline_cls: type, folder: Path, **call) -> np.ndarray:
    pipe = pipeline_cls.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return np.array(pipe(**call, generator=torch.Generator().manual_seed(7)).images[0])


CALL = {"prompt": "a red fox in the snow", "height": 32, "width": 32, "num_inference_steps": 2}


# --- the published folder loads and computes what the in-memory pipeline computes ------------------------------

def test_klein_pipeline_loads_published_folder_bit_identical(port: dict, published: Path) -> None:
    from diffusers import Flux2KleinPipeline

    index = json.loads((published / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline"
    assert index["is_distilled"] is True  # carried from the base's model_index.json
    assert index["transformer"] == ["diffusers", "Flux2Transformer2DModel"]
    got = loaded_image(Flux2KleinPipeline, published, **CALL)
    want = in_memory_image(Flux2KleinPipeline, port["transformer"], **CALL)
    assert got.shape == (32, 32, 3) and got.std() > 0
    assert np.array_equal(got, want)


def test_kv_variant_loads_with_kv_pipeline_bit_identical(port: dict, tmp_path: Path) -> None:
    from diffusers import Flux2KleinKVPipeline

    out = tmp_path / "kv"
    result = publish(port["base"], port["transformer"], out, report=port["pass"], variant="klein-kv")
    index = json.loads((out / "model_index.json").read_text())
    assert result.pipeline == index["_class_name"] == "Flux2KleinKVPipeline"
    assert "is_distilled" not in index  # the KV pipeline does not register it (flux2-checkpoints.md 8.2)
    got = loaded_image(Flux2KleinKVPipeline, out, **CALL)
    want = in_memory_image(Flux2KleinKVPipeline, port["transformer"], **CALL)
    assert np.array_equal(got, want)


# --- the validation gate -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("which, status", [
    (None, "missing"),       # no --report at all
    ("fail", "fail"),        # a report for these weights whose verdict is fail
    ("other", "mismatch"),   # a passing report, but for other weights
])
def test_gate_refuses_and_writes_nothing(port: dict, tmp_path: Path, which: str | None, status: str) -> None:
    out = tmp_path / "pub"
    with pytest.raises(CheckFailed) as exc:
        publish(port["base"], port["transformer"], out, report=port[which] if which else None)
    assert exc.value.exit_code == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []
    if status == "mismatch":
        assert port["weights"][:16] in exc.value.message and "0000000000000000" in exc.value.message


def test_gate_refusal_exit_code_on_cli(port: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["publish", "--base", str(port["base"]), "--transformer", str(port["transformer"]),
                              "--report", str(port["other"].parent), "--out", str(tmp_path / "pub"), "--json"],
                             capsys)
    assert code == 1
    doc = json.loads(out)
    assert doc["exit_code"] == 1 and "other weights" in doc["error"]
    assert "Traceback" not in err and not (tmp_path / "pub").exists()


def test_skip_validation_says_so_in_the_card(port: dict, tmp_path: Path) -> None:
    result = publish(port["base"], port["transformer"], tmp_path / "pub", report=port["fail"], skip_validation=True)
    card = (tmp_path / "pub" / "README.md").read_text()
    assert result.gate.status == "fail"
    assert "**Not validated.**" in card and "--skip-validation" in card
    manifest = json.loads((tmp_path / "pub" / "manifest.json").read_text())
    assert manifest["validation"] == {"status": "fail", "message": result.gate.message, "enforced": False}


def test_transformer_changed_after_convert_is_refused(port: dict, tmp_path: Path) -> None:
    moved = tmp_path / "transformer"
    shutil.copytree(port["transformer"], moved)
    manifest = json.loads((moved / "flux-port.json").read_text())
    manifest["weights_sha256"] = "f" * 64
    (moved / "flux-port.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckFailed, match="weights changed since port convert"):
        publish(port["base"], moved, tmp_path / "pub", report=port["pass"])


# --- consistency of base and fine-tune ----------------------------------------------------------------------------

def test_finetune_of_another_architecture_is_refused(port: dict, tmp_path: Path) -> None:
    # a fine-tune with 3 double blocks cannot sit on a base with 2
    src = write_random_checkpoint(tmp_path / "ft3.safetensors", {**TINY_FLUX2, "num_layers": 3}, seed=2)
    weights = convert(src, tmp_path / "transformer3", strict=True).weights_sha256
    report = write_report(tmp_path / "reports", weights)
    with pytest.raises(CheckFailed) as exc:
        publish(port["base"], tmp_path / "transformer3", tmp_path / "pub", report=report)
    assert "num_layers: base" in exc.value.details and "has 2, the fine-tune has 3" in exc.value.details
    assert not (tmp_path / "pub").exists()


@pytest.mark.parametrize("component, key, value, expected", [
    # text encoder hidden 32: 3 x 32 = 96 is not the transformer's joint_attention_dim 48
    ("text_encoder", "hidden_size", 32, "hidden_size 32 x 3 = 96"),
    # VAE with 8 latent channels: 8 x 4 = 32 is not the transformer's in_channels 16
    ("vae", "latent_channels", 8, "latent_channels 8 x 4 (2x2 patches) = 32"),
])
def test_base_components_must_fit_the_transformer(port: dict, tmp_path: Path, component: str, key: str,
                                                  value: int, expected: str) -> None:
    base = tmp_path / "base"
    shutil.copytree(port["base"], base)
    cfg_path = base / component / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckFailed) as exc:
        publish(base, port["transformer"], tmp_path / "pub", report=port["pass"])
    assert expected in exc.value.details
    assert ("joint_attention_dim is 48" if component == "text_encoder" else "in_channels is 16") in exc.value.details


def test_dev_variant_on_a_klein_base_is_refused(port: dict, tmp_path: Path) -> None:
    with pytest.raises(CheckFailed) as exc:
        publish(port["base"], port["transformer"], tmp_path / "pub", report=port["pass"], variant="dev")
    assert "Mistral3ForConditionalGeneration" in exc.value.details and "guidance_embeds" in exc.value.details


# --- links, copies and atomicity -------------------------------------------------------------------------------------

def test_hard_links_share_the_inode(port: dict, published: Path) -> None:
    for rel in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                "tokenizer/tokenizer.json", "scheduler/scheduler_config.json"):
        assert os.stat(published / rel).st_ino == os.stat(port["base"] / rel).st_ino, rel
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert os.stat(published / weights).st_ino == os.stat(port["transformer"] / weights.split("/")[1]).st_ino


def test_hard_link_refused_falls_back_to_copy(port: dict, tmp_path: Path) -> None:
    def cross_device(src: Path, dst: Path) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    result = publish(port["base"], port["transformer"], tmp_path / "pub", report=port["pass"], hardlink=cross_device)
    rel = "vae/diffusion_pytorch_model.safetensors"
    assert os.stat(tmp_path / "pub" / rel).st_ino != os.stat(port["base"] / rel).st_ino
    assert (tmp_path / "pub" / rel).read_bytes() == (port["base"] / rel).read_bytes()
    assert "hardlink" not in result.counts() and any("copied" in n for n in result.notices)


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(Path.cwd()).st_dev,
                    reason="needs /dev/shm on another filesystem than the working directory")
def test_real_cross_filesystem_publish_copies(port: dict, tmp_path: Path) -> None:
    out_parent = Path(os.environ.get("FLUX_PORT_SHM", "/dev/shm")) / f"flux-port-test-{os.getpid()}"
    if os.stat("/dev/shm").st_dev == os.stat(port["base"]).st_dev:
        pytest.skip("the test files already live on /dev/shm's filesystem")
    try:
        result = publish(port["base"], port["transformer"], out_parent / "pub", report=port["pass"])
        assert result.counts().get("copy", 0) >= 12 and "hardlink" not in result.counts()
        assert any("another filesystem" in n for n in result.notices)
    finally:
        shutil.rmtree(out_parent, ignore_errors=True)


def test_symlink_mode(port: dict, tmp_path: Path) -> None:
    publish(port["base"], port["transformer"], tmp_path / "pub", report=port["pass"], link="symlink")
    link = tmp_path / "pub" / "vae" / "config.json"
    assert link.is_symlink() and link.resolve() == (port["base"] / "vae" / "config.json").resolve()


def test_failure_midway_leaves_no_partial_folder(port: dict, tmp_path: Path) -> None:
    calls = []

    def disk_fails_on_fifth(src: Path, dst: Path) -> None:
        calls.append(src)
        if len(calls) == 5:
            raise OSError(errno.EIO, "Input/output error", str(dst))
        os.link(src, dst)

    with pytest.raises(OSError):
        publish(port["base"], port["transformer"], tmp_path / "pub", report=port["pass"], hardlink=disk_fails_on_fifth)
    assert len(calls) == 5 and list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(port: dict, tmp_path: Path) -> None:
    out = tmp_path / "pub"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="already exists"):
        publish(port["base"], port["transformer"], out, report=port["pass"])
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(Exception, match="was not written by flux-port"):  # --force never deletes the user's files
        publish(port["base"], port["transformer"], out, report=port["pass"], force=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    mine = tmp_path / "mine"
    publish(port["base"], port["transformer"], mine, report=port["pass"])
    publish(port["base"], port["transformer"], mine, report=port["pass"], force=True)  # its own, untouched
    assert (mine / "model_index.json").is_file()
    (mine / "README.md").write_text("edited")  # a file the tool wrote, edited to another size: the user's work now
    with pytest.raises(Exception, match=r"did not write \('README.md'\)"):
        publish(port["base"], port["transformer"], mine, report=port["pass"], force=True)
    assert (mine / "README.md").read_text() == "edited"


# --- what the folder says about itself -----------------------------------------------------------------------------

def test_manifest_lists_sha256_of_every_file(published: Path) -> None:
    manifest = json.loads((published / "manifest.json").read_text())
    on_disk = {p.relative_to(published).as_posix() for p in published.rglob("*") if p.is_file()}
    on_disk -= {"manifest.json", RECORD}  # the manifest itself, and the ownership record (porting/outputs.py)
    assert set(manifest["files"]) == on_disk
    for rel, info in manifest["files"].items():
        assert info["sha256"] == hashlib.sha256((published / rel).read_bytes()).hexdigest(), rel
    assert manifest["pipeline"] == "Flux2KleinPipeline" and manifest["validation"]["enforced"] is True


def test_model_card_metadata_and_validation_table(port: dict, published: Path) -> None:
    card = (published / "README.md").read_text()
    header = card.split("---\n")[1]
    for line in ('base_model: "black-forest-labs/FLUX.2-klein-4B"', 'base_model_relation: "finetune"',
                 'library_name: "diffusers"', 'pipeline_tag: "text-to-image"', 'license: "apache-2.0"'):
        assert line in header
    assert port["weights"] in card and "`flux2`" in card and "tiny-klein-ft.safetensors" in card
    assert "| t=1.0 | 0.0123 | 0.0119 | 1.03 |" in card and "Verdict **pass**" in card
    assert (published / "report.json").is_file() and (published / "report.md").is_file()


def test_cli_publish_json_document(port: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["publish", "--base", str(port["base"]), "--transformer", str(port["transformer"]),
                              "--report", str(port["pass"]), "--out", str(tmp_path / "pub"), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["pipeline"] == "Flux2KleinPipeline" and doc["validation"]["status"] == "pass"
    assert doc["how"]["hardlink"] >= 12


def test_publish_recipe_from_workspace(port: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # `port publish RECIPE` reads the workspace that fetch/convert/validate filled, and records itself in port.json
    workspace = pytest.importorskip("porting.hub.workspace")
    name = "flux2-klein-4b"  # a shipped recipe: the card names its base repository
    recipe = tmp_path / "ws" / name
    shutil.copytree(port["base"], recipe / "base")
    shutil.copytree(port["transformer"], recipe / "transformer")
    shutil.copytree(port["pass"].parent, recipe / "reports")
    monkeypatch.setenv("FLUX_PORT_HOME", str(tmp_path / "ws"))
    code, out, err = run_cli(["publish", name, "--json"], capsys)
    assert code == 0, err
    assert (recipe / "published" / "model_index.json").is_file()
    record = workspace.read_port_json(workspace.recipe_paths(name))
    assert record["publish"]["validation"]["status"] == "pass"
    try:
        from porting.hub.recipes import get_recipe
        repo = get_recipe(name).base.repo
    except Exception:  # recipes not shipped in this build: the base folder's name stands in
        repo = "base"
    assert f'base_model: "{repo}"' in (recipe / "published" / "README.md").read_text()


def test_real_validate_report_gates_publish(port: dict, tmp_path: Path) -> None:
    # the contract end to end: port validate's own report.json (not a hand-written one) opens the gate
    api = pytest.importorskip("validation.api")
    report = api.validate(port["transformer"], device="cpu", out=tmp_path / "reports", resolution=32, text_len=16,
                          timesteps=(1.0,), base=port["base"], prompt="a fox")
    assert report.verdict == "pass"
    result = publish(port["base"], port["transformer"], tmp_path / "pub", report=tmp_path / "reports")
    assert result.gate.passed
    card = (tmp_path / "pub" / "README.md").read_text()
    assert "Verdict **pass**" in card and "| all cases |" in card


def test_report_found_where_validate_writes_it(port: dict, tmp_path: Path) -> None:
    # port validate DIR writes DIR/../reports/report.json by default; publish looks there when --report is absent
    shutil.copytree(port["transformer"], tmp_path / "transformer")
    write_report(tmp_path / "reports", port["weights"])
    result = publish(port["base"], tmp_path / "transformer", tmp_path / "pub")
    assert result.gate.passed and result.gate.path == tmp_path / "reports" / "report.json"
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "pub").stat().st_mode & 0o777 == 0o777 & ~umask  # not the staging folder's private mode


def test_the_report_found_is_the_newest_of_these_weights(port: dict, tmp_path: Path) -> None:
    """reports/ next to the transformer is shared (the demo validates its port, then its merge there): without
    --report, publish takes the newest report of the weights it publishes, not a newer one of other weights."""
    shutil.copytree(port["transformer"], tmp_path / "transformer")
    mine = write_report(tmp_path / "reports" / "validate" / "20261204-100000", port["weights"])
    write_report(tmp_path / "reports" / "validate" / "20261204-110000", "e" * 64)  # newer: the merged weights
    result = publish(port["base"], tmp_path / "transformer", tmp_path / "pub")
    assert result.gate.passed and result.gate.path == mine


def test_card_carries_the_source_hash_port_fetch_recorded(tmp_path: Path) -> None:
    from porting.demo.tinypipe import build_demo_base

    src = write_random_checkpoint(tmp_path / "finetune" / "ft.safetensors", TINY_FLUX2, seed=4)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    (tmp_path / "finetune" / "fetch-manifest.json").write_text(json.dumps(
        {"format_version": 1, "files": [{"path": "ft.safetensors", "size": src.stat().st_size, "sha256": digest}]}))
    weights = convert(src, tmp_path / "transformer", strict=True).weights_sha256
    write_report(tmp_path / "reports", weights)
    base = build_demo_base(tmp_path / "base")
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: flux-non-commercial-license\n"
                                    "license_link: LICENSE.md\n---\n# base\n")
    publish(base, tmp_path / "transformer", tmp_path / "pub")
    card = (tmp_path / "pub" / "README.md").read_text()
    assert f"| source sha256 | `{digest}` |" in card
    assert 'license: "other"\nlicense_name: "flux-non-commercial-license"\nlicense_link: "LICENSE.md"' in card
