"""Data safety, inputs (issue 17, items 3 and 4): every path a verb reads is an input that `--out` must not be,
contain or lie inside; names read from inputs are plain names; links are followed only inside their input root.

Every case hashes the files around the output before and after, and asserts exit code 2, the input or name in the
message and no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image

from porting.adapters.convert import convert_adapter
from porting.errors import EXIT_USAGE
from porting.outputs import write_record
from porting.paths import UnsafeInputError, check_plain_name, link_roots
from porting.pipeline.generate import save_png
from porting.pipeline.publish import publish

from .helpers import leftovers, run_port, save_state
from .lorakit import BY_NAME, adapter_for, make_parts, write_adapter
from .test_safety import assert_clean_refusal, snapshot
from .tinyport import write_report

FAST = ["--steps", "1", "--size", "32"]


@pytest.fixture(scope="module")
def published(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A published tiny pipeline (read-only for these tests: each refusal must leave it as it was)."""
    out = tmp_path_factory.mktemp("inputs-pub") / "klein"
    publish(port["base"], port["transformer"], out, report=port["pass"], link="copy")
    return out


def photo(path: Path, ours: bool = False) -> Path:
    """A 64 x 64 PNG (the smallest reference image the pipelines take); `ours`: as flux-port writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (64, 64), (200, 10, 10))
    if ours:
        save_png(image, path)
    else:
        image.save(path)
    return path


# --- merge: the adapters are inputs ----------------------------------------------------------------------------------

@pytest.fixture
def merge_inputs(tmp_path: Path, tiny2_state) -> dict[str, Path]:
    """A base file in its own folder, and a kohya adapter alone in a folder of the user's (with a note)."""
    base = save_state(tmp_path / "base" / "base.safetensors", tiny2_state)
    adapter, _ = adapter_for(tmp_path / "loras" / "style.safetensors", BY_NAME["kohya"], tiny2_state, seed=1)
    (tmp_path / "loras" / "notes.txt").write_text("trigger word: zzstyle\n")
    return {"root": tmp_path, "base": base, "adapter": adapter, "folder": adapter.parent}


@pytest.mark.parametrize("where, relation", [
    ("file", "is"),                # --out is the adapter file itself
    ("folder", "contains"),        # --out is the folder holding it
    ("inside", "lies inside"),     # --out inside an adapter given as a folder
])
def test_merge_out_over_or_around_an_adapter_is_refused(capsys, merge_inputs: dict, where: str,
                                                        relation: str) -> None:
    adapter = merge_inputs["folder"] if where == "inside" else merge_inputs["adapter"]
    if where == "inside":
        (merge_inputs["folder"] / "notes.txt").unlink()  # a folder holding one adapter file is an adapter input
    out = {"file": merge_inputs["adapter"], "folder": merge_inputs["folder"],
           "inside": merge_inputs["folder"] / "merged"}[where]
    before = snapshot(merge_inputs["root"])
    run = run_port(capsys, "merge", merge_inputs["base"], adapter, "--out", out, "--force")
    assert_clean_refusal(run, 2, f"the output {relation} the adapter {adapter}", "Nothing was changed")
    assert snapshot(merge_inputs["root"]) == before


# --- convert: the quantize path and adapters name what they read -----------------------------------------------------

def test_convert_quantize_inside_a_source_folder_is_refused(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    source = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", source, "-q").code == 0
    before = snapshot(tmp_path)
    run = run_port(capsys, "convert", source, "--to", "original", "--quantize", "gguf-q8_0",
                   "--out", source / "gguf")
    assert_clean_refusal(run, 2, f"the output lies inside the source {source}")
    assert snapshot(tmp_path) == before


def test_adapter_convert_never_replaces_the_folder_of_its_config(capsys, tmp_path: Path, tiny2_file: Path,
                                                                 tiny2_state) -> None:
    """--config is an input: a converted transformer folder holding it is not replaced by an adapter."""
    transformer = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", transformer, "-q").code == 0
    adapter, _ = adapter_for(tmp_path / "style.safetensors", BY_NAME["kohya"], tiny2_state, seed=2)
    before = snapshot(tmp_path)
    run = run_port(capsys, "convert", adapter, "--config", transformer / "config.json", "--out", transformer,
                   "--force")
    assert_clean_refusal(run, 2, "the output contains the --config")
    assert snapshot(tmp_path) == before


# --- validate: its inputs, and only its own report folders -----------------------------------------------------------

def test_validate_never_replaces_a_convert_output(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    other = tmp_path / "other-transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", other, "-q").code == 0
    before = snapshot(tmp_path)
    run = run_port(capsys, "validate", tiny2_file, "--out", other, "--resolution", "32", "--text-len", "8")
    assert_clean_refusal(run, 2, "is the output of `port convert`, not of `port validate`")
    assert snapshot(tmp_path) == before


def test_validate_out_around_its_config_is_refused(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    transformer = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", transformer, "-q").code == 0
    config = tmp_path / "base" / "config.json"
    config.parent.mkdir()
    shutil.copy(transformer / "config.json", config)
    before = snapshot(tmp_path)
    run = run_port(capsys, "validate", tiny2_file, "--config", config, "--out", config.parent,
                   "--resolution", "32", "--text-len", "8")
    assert_clean_refusal(run, 2, f"the output contains the --config {config}")
    assert snapshot(tmp_path) == before


# --- compare, generate, bench, export: reports, configs, images, prompt files, components ---------------------------

@pytest.mark.parametrize("kind", ["--image", "--prompts", "--lpips-weights", "candidate transformer"])
def test_compare_out_over_each_input_kind_is_refused(capsys, published: Path, tmp_path: Path, kind: str) -> None:
    user = tmp_path / "user"
    image, prompts, weights = photo(user / "ref.png"), user / "prompts.txt", user / "alexnet.pth"
    prompts.write_text("a red fox\n")
    weights.write_bytes(b"not really weights")
    transformer = tmp_path / "swap"
    shutil.copytree(published / "transformer", transformer)
    args = {"--image": ["-p", "x", "--image", image], "--prompts": ["--prompts", prompts],
            "--lpips-weights": ["-p", "x", "--lpips-weights", weights],
            "candidate transformer": ["-p", "x", "--candidate-transformer", transformer]}[kind]
    out = transformer / "cmp" if kind == "candidate transformer" else user
    relation = "lies inside" if kind == "candidate transformer" else "contains"
    before, published_before = snapshot(tmp_path), snapshot(published)
    run = run_port(capsys, "compare", published, published, *FAST, *args, "--out", out, "--force")
    assert_clean_refusal(run, 2, f"the output {relation} the {kind}")
    assert snapshot(tmp_path) == before and snapshot(published) == published_before


@pytest.mark.parametrize("case", ["image", "inside"])
def test_generate_output_over_an_input_is_refused(capsys, published: Path, tmp_path: Path, case: str) -> None:
    image = photo(tmp_path / "edit.png", ours=True)  # even an image flux-port wrote, when it is this run's input
    output = image if case == "image" else published / "fox.png"
    before, published_before = snapshot(tmp_path), snapshot(published)
    run = run_port(capsys, "generate", published, "--prompt", "x", *FAST, "--image", image, "--output", output)
    assert_clean_refusal(run, 2, f"the output is the --image {image}" if case == "image"
                         else f"the output lies inside the pipeline folder {published}")
    assert snapshot(tmp_path) == before and snapshot(published) == published_before


def test_bench_out_around_its_image_is_refused_before_running(capsys, published: Path, tmp_path: Path) -> None:
    image = photo(tmp_path / "mine" / "ref.png")
    before = snapshot(tmp_path)
    run = run_port(capsys, "bench", published, "--offload", "none", "--task", "edit", "--image", image, *FAST,
                   "--out", image.parent, "--force")
    assert_clean_refusal(run, 2, f"the output contains the --image {image}")
    assert snapshot(tmp_path) == before


def test_export_out_inside_a_linked_component_is_refused(capsys, published: Path, tmp_path: Path) -> None:
    """A pipeline folder whose transformer/ links elsewhere: that folder is an input too, links resolved."""
    pipeline = tmp_path / "pipeline"
    shutil.copytree(published, pipeline, ignore=shutil.ignore_patterns("transformer"))
    real = tmp_path / "transformers" / "ft"
    shutil.copytree(published / "transformer", real)
    (pipeline / "transformer").symlink_to(real)
    before = snapshot(tmp_path)
    run = run_port(capsys, "export", pipeline, "--out", real / "onnx", "--components", "transformer")
    assert_clean_refusal(run, 2, "the output lies inside the component")
    assert snapshot(tmp_path) == before


def test_export_never_copies_a_link_out_of_the_source(capsys, published: Path, tmp_path: Path) -> None:
    pipeline = tmp_path / "pipeline"
    shutil.copytree(published, pipeline)
    secret = tmp_path / "secret.txt"
    secret.write_text("ssh key")
    (pipeline / "tokenizer" / "extra.txt").symlink_to(secret)
    before = snapshot(tmp_path)
    run = run_port(capsys, "export", pipeline, "--out", tmp_path / "onnx", "--components", "vae_decoder")
    assert_clean_refusal(run, 2, "extra.txt: a symbolic link to", "secret.txt, outside")
    assert snapshot(tmp_path) == before and leftovers(tmp_path / "onnx") == []


# --- publish: the report, adapters, and what it copies ---------------------------------------------------------------

@pytest.fixture
def workspace(port: dict, tmp_path: Path) -> Path:
    """The workspace layout: transformer/ and the validate report folder reports/ beside it."""
    shutil.copytree(port["transformer"], tmp_path / "transformer")
    write_report(tmp_path / "reports", port["weights"])
    write_record(tmp_path / "reports", "validate")  # as port validate leaves it: flux-port's, replaceable
    return tmp_path


def test_publish_force_never_replaces_the_report_it_found(capsys, port: dict, workspace: Path) -> None:
    before = snapshot(workspace)
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", workspace / "transformer",
                   "--out", workspace / "reports", "--force")
    assert_clean_refusal(run, 2, f"the output is the report {workspace / 'reports'}")
    assert snapshot(workspace) == before


def test_publish_out_inside_an_adapter_is_refused(capsys, port: dict, tmp_path: Path) -> None:
    adapter = tiny_converted_adapter(tmp_path / "style")
    before = snapshot(tmp_path)
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"], "--report",
                   port["pass"], "--adapter", adapter, "--out", adapter / "published")
    assert_clean_refusal(run, 2, f"the output lies inside the adapter {adapter}")
    assert snapshot(tmp_path) == before


def tiny_converted_adapter(folder: Path) -> Path:
    from porting.demo.tiny import TINY_FLUX2, model_shapes

    shapes = {k[: -len(".weight")]: tuple(s) for k, s in model_shapes(TINY_FLUX2).items() if k.endswith(".weight")}
    parts = make_parts(shapes, ["double_blocks.0.img_attn.qkv"], "lora", seed=3, alpha=1.0)
    src = write_adapter(folder.parent / f"{folder.name}-kohya.safetensors", BY_NAME["kohya"], parts)
    convert_adapter(src, folder)
    return folder


@pytest.mark.parametrize("what", ["report.md", "adapter manifest"])
def test_publish_never_follows_a_link_out_of_a_report_or_adapter(port: dict, tmp_path: Path, what: str) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("ssh key")
    report = tmp_path / "report"
    write_report(report, port["weights"])
    adapters = []
    if what == "report.md":
        (report / "report.md").unlink()
        (report / "report.md").symlink_to(secret)
        link = report / "report.md"
    else:
        adapter = tiny_converted_adapter(tmp_path / "style")
        manifest = adapter / "flux-port-adapter.json"
        shutil.move(manifest, tmp_path / "elsewhere.json")
        manifest.symlink_to(tmp_path / "elsewhere.json")
        adapters, link = [adapter], manifest
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeInputError, match=rf"{link.name}: a symbolic link to .*, outside") as exc:
        publish(port["base"], port["transformer"], tmp_path / "pub", report=report, adapters=adapters)
    assert exc.value.exit_code == EXIT_USAGE
    assert snapshot(tmp_path) == before and leftovers(tmp_path / "pub") == []


def test_adapter_manifest_naming_a_path_is_refused(port: dict, tmp_path: Path) -> None:
    adapter = tiny_converted_adapter(tmp_path / "style")
    manifest = adapter / "flux-port-adapter.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "file": "../../id_rsa"}))
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeInputError, match=r"flux-port-adapter.json: file '../../id_rsa' is not a plain name"):
        publish(port["base"], port["transformer"], tmp_path / "pub", report=port["pass"], adapters=[adapter])
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["../evil", "a/b", "/abs", "", ".."])
def test_publish_refuses_a_component_that_is_not_a_plain_name(capsys, port: dict, tmp_path: Path, name: str) -> None:
    base = tmp_path / "base"
    shutil.copytree(port["base"], base)
    (tmp_path / "evil").mkdir()  # what "../evil" would reach: published next to --out, had it been followed
    (tmp_path / "evil" / "payload.bin").write_bytes(b"x")
    index = json.loads((base / "model_index.json").read_text())
    index[name] = ["diffusers", "AutoencoderKLFlux2"]
    (base / "model_index.json").write_text(json.dumps(index))
    before = snapshot(tmp_path)
    run = run_port(capsys, "publish", "--base", base, "--transformer", port["transformer"], "--report", port["pass"],
                   "--out", tmp_path / "out" / "pub")
    assert_clean_refusal(run, 2, f"model_index.json: component {name!r} is not a plain name")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_generate_refuses_a_component_that_is_not_a_plain_name(capsys, published: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pub"
    shutil.copytree(published, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["vae"] = ["diffusers", "AutoencoderKLFlux2"]
    index["../vae"] = index.pop("vae")
    (folder / "model_index.json").write_text(json.dumps(index))
    before = snapshot(tmp_path)
    run = run_port(capsys, "generate", folder, "--prompt", "x", *FAST, "--output", tmp_path / "x.png")
    assert_clean_refusal(run, 2, "component '../vae' is not a plain name")
    assert snapshot(tmp_path) == before


def test_a_shard_index_naming_a_path_is_refused(capsys, tmp_path: Path, tiny2_state) -> None:
    folder = tmp_path / "sharded"
    save_state(folder / "model-00001-of-00001.safetensors", tiny2_state)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "../model-00001-of-00001.safetensors" for k in tiny2_state}}))
    before = snapshot(tmp_path)
    run = run_port(capsys, "convert", folder, "--out", tmp_path / "out")
    assert_clean_refusal(run, 2, "shard file '../model-00001-of-00001.safetensors' is not a plain name")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name, ok", [("vae", True), ("a.b-c_d", True), ("..", False), ("a/b", False),
                                      ("a\\b", False), ("/etc", False), ("C:x", False), ("", False),
                                      ("a\nb", False), (3, False)])
def test_plain_names(name: object, ok: bool) -> None:
    if ok:
        assert check_plain_name(name, "model_index.json", "component") == name
    else:
        with pytest.raises(UnsafeInputError, match="model_index.json: component"):
            check_plain_name(name, "model_index.json", "component")


# --- links: inside the input root only; the Hugging Face cache's own blobs -------------------------------------------

def test_publish_refuses_a_component_folder_linked_out_of_the_base(port: dict, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(port["base"], base, ignore=shutil.ignore_patterns("vae"))
    shutil.copytree(port["base"] / "vae", tmp_path / "elsewhere" / "vae")
    (base / "vae").symlink_to(tmp_path / "elsewhere" / "vae")
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeInputError, match=r"vae: a symbolic link to .*elsewhere/vae, outside"):
        publish(base, port["transformer"], tmp_path / "pub", report=port["pass"])
    assert snapshot(tmp_path) == before and leftovers(tmp_path / "pub") == []


def hub_snapshot(cache: Path, repo: str, base: Path, blobs_of: str | None = None) -> Path:
    """`base` as a Hugging Face cache entry models--org--REPO/snapshots/REV whose files link into the blobs of
    `blobs_of` (default: its own repository)."""
    entry, blobs = cache / f"models--org--{repo}", cache / f"models--org--{blobs_of or repo}" / "blobs"
    snapshot_dir = entry / "snapshots" / "0123abc"
    blobs.mkdir(parents=True, exist_ok=True)
    (entry / "blobs").mkdir(parents=True, exist_ok=True)
    for src in sorted(base.rglob("*")):
        rel = src.relative_to(base)
        dst = snapshot_dir / rel
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        blob = blobs / hashlib.sha256(rel.as_posix().encode()).hexdigest()
        shutil.copy(src, blob)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(os.path.relpath(blob, dst.parent))
    return snapshot_dir


def test_hub_cache_links_into_its_own_blobs_are_followed(port: dict, tmp_path: Path) -> None:
    snapshot_dir = hub_snapshot(tmp_path / "hub", "base", port["base"])
    assert link_roots(snapshot_dir) == [snapshot_dir.resolve(), (snapshot_dir.parents[1] / "blobs").resolve()]
    out = tmp_path / "pub"
    publish(snapshot_dir, port["transformer"], out, report=port["pass"], link="copy")
    assert (out / "vae" / "config.json").is_file() and not (out / "vae" / "config.json").is_symlink()


def test_hub_cache_links_into_another_repositorys_blobs_are_refused(port: dict, tmp_path: Path) -> None:
    snapshot_dir = hub_snapshot(tmp_path / "hub", "base", port["base"], blobs_of="other")
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeInputError, match=r"a symbolic link to .*models--org--other/blobs/.*, outside"):
        publish(snapshot_dir, port["transformer"], tmp_path / "pub", report=port["pass"], link="copy")
    assert snapshot(tmp_path) == before and leftovers(tmp_path / "pub") == []


def test_hub_cache_links_elsewhere_in_the_same_repository_are_refused(port: dict, tmp_path: Path) -> None:
    """Only blobs/ is exempt: a link to another place in the cache entry (here refs/) is outside the snapshot."""
    snapshot_dir = hub_snapshot(tmp_path / "hub", "base", port["base"])
    stray = snapshot_dir.parents[1] / "refs" / "vae-config.json"
    stray.parent.mkdir()
    shutil.copy(port["base"] / "vae" / "config.json", stray)
    (snapshot_dir / "vae" / "config.json").unlink()
    (snapshot_dir / "vae" / "config.json").symlink_to(stray)
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeInputError, match=r"config.json: a symbolic link to .*refs/vae-config.json, outside"):
        publish(snapshot_dir, port["transformer"], tmp_path / "pub", report=port["pass"], link="copy")
    assert snapshot(tmp_path) == before
