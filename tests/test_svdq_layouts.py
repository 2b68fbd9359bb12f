"""SVDQuant in both file layouts: `port convert --quantize svdq-* --layout diffusers` writes diffusers' own Nunchaku
folder (judged by diffusers' `replace_with_nunchaku_linear` and `check_strict_state_dict_match`), and
`port convert FILE --layout diffusers|nunchaku` moves a model between the layouts without requantizing where that
is exact: flux-port's own files read back bit for bit in bf16 either way; another writer's layers whose pieces do
not share their factors are requantized, each named with its error."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from .helpers import reference_model, run_port, save_state

pytest.importorskip("deepcompressor.backend.nunchaku.convert",
                    reason="the oracle: pip install --no-deps deepcompressor-toolkit==0.1.0 (as .ci/run does)")

from .litefiles import check_with_diffusers, write_lite_folder  # noqa: E402
from .svdqfiles import write_svdq_file  # noqa: E402
from .test_svdquant_write import TINY1, TINY2  # noqa: E402

CASES = [("flux2", "int4"), ("flux2", "nvfp4"), ("flux1", "int4"), ("flux1", "nvfp4")]


def _port(*argv) -> dict:
    import contextlib
    import io

    from porting.cli.app import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # a module-scoped fixture has no capsys
        try:
            main([str(a) for a in argv] + ["--json", "--quiet"])
        except SystemExit as e:
            assert not e.code, buf.getvalue()
    return json.loads(buf.getvalue())


DIRECT = [("flux2", "nvfp4"), ("flux1", "int4")]  # also written with --quantize ... --layout diffusers directly


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[tuple[str, str], dict[str, Path]]:
    """Each tiny model quantized by flux-port (Nunchaku's layout), moved into diffusers' layout and back; two of
    them also written in diffusers' layout directly."""
    root = tmp_path_factory.mktemp("layouts")
    sources = {"flux1": save_state(root / "flux1-tiny.safetensors", reference_model(TINY1, seed=3).state_dict(),
                                   torch.bfloat16),
               "flux2": save_state(root / "klein-tiny.safetensors", reference_model(TINY2, seed=4).state_dict(),
                                   torch.bfloat16)}
    out = {}
    for family, precision in CASES:
        base = root / f"{family}-{precision}"
        doc = _port("convert", sources[family], "--quantize", f"svdq-{precision}", "--out", base / "nunchaku")
        paths = {"nunchaku": base / "nunchaku" / doc["files"][0]}
        if (family, precision) in DIRECT:
            doc = _port("convert", sources[family], "--quantize", f"svdq-{precision}", "--layout", "diffusers",
                        "--out", base / "diffusers")
            assert doc["layout"]["requantized"] == [] and doc["files"] == ["diffusion_pytorch_model.safetensors"]
            # the report and the manifest name what was written and from what, not the file moved in between
            written = base / "diffusers" / doc["files"][0]
            assert doc["file_sha256"] == hashlib.sha256(written.read_bytes()).hexdigest()
            manifest = json.loads((base / "diffusers" / "flux-port.json").read_text())
            assert manifest["source"] == str(sources[family].resolve())
            paths["diffusers"] = base / "diffusers"
        doc = _port("convert", paths["nunchaku"], "--layout", "diffusers", "--out", base / "to-diffusers")
        assert doc["layout"]["requantized"] == [], doc["layout"]
        paths["to-diffusers"] = base / "to-diffusers"
        doc = _port("convert", paths["to-diffusers"], "--layout", "nunchaku", "--out", base / "to-nunchaku")
        assert doc["layout"]["requantized"] == [], doc["layout"]
        paths["to-nunchaku"] = base / "to-nunchaku" / doc["files"][0]
        out[family, precision] = paths
    return out


def _readings(path: Path) -> dict[str, torch.Tensor]:
    from porting.inputs import open_source

    view = open_source(path, kind="weights").view
    return {key: view.read(key, dtype=torch.bfloat16) for key in view.tensors}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_own_files_read_the_same_in_either_layout(own, case):
    """The bf16 reading of flux-port's file is identical in Nunchaku's layout, written in diffusers' layout, and
    moved either way (FLUX.1 int4's GELU-shifted biases within one bf16 step: the shift is added in float32)."""
    paths = own[case]
    want = _readings(paths["nunchaku"])
    for name in ("diffusers", "to-diffusers", "to-nunchaku"):
        if name not in paths:
            continue
        got = _readings(paths[name])
        assert set(got) == set(want), name
        for key, t in want.items():
            if torch.equal(got[key], t):
                continue
            assert case == ("flux1", "int4") and key.endswith(".bias"), (name, key)
            assert float((got[key].float() - t.float()).abs().max()) <= float(t.float().abs().max()) * 2**-7


def test_diffusers_accepts_flux_ports_folders(own, tmp_path):
    """diffusers' own replacement and strict key check, with the shapes and dtypes its modules declare, on every
    folder flux-port writes in its layout; and on the helper's independent folders, the control."""
    folders = [own[case][name] for case in CASES for name in ("diffusers", "to-diffusers") if name in own[case]]
    control = [write_lite_folder(tmp_path / "control", *case).path for case in CASES]
    faults = _faulty_copies(own["flux2", "nvfp4"]["to-diffusers"], tmp_path / "faults")
    verdicts = check_with_diffusers(folders + control + list(faults), tmp_path)
    for folder in folders + control:
        got = verdicts[str(folder)]
        assert got["errors"] == [] and got["replaced"] > 0, (folder, got["errors"][:3])
    for folder, phrase in faults.items():  # the check is not vacuous: each injected fault is caught
        assert any(phrase in e for e in verdicts[str(folder)]["errors"]), (phrase, verdicts[str(folder)])
    config = json.loads((own["flux2", "int4"]["to-diffusers"] / "config.json").read_text())
    qc = config["quantization_config"]
    # klein's joined layers carry both pieces' branches: rank 32 asked, 64 in diffusers' layout, 32 again back
    assert qc["svdq_w4a4"]["rank"] == 64 and own["flux2", "int4"]["to-nunchaku"].name.startswith("svdq-int4_r32-")
    assert qc["quant_method"] == "nunchaku_lite" and "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in \
        qc["svdq_w4a4"]["targets"] and "transformer_blocks.0.attn.to_q" in qc["svdq_w4a4"]["targets"]


def _faulty_copies(folder: Path, root: Path) -> dict[Path, str]:
    """Copies of a good folder with one fault each -> what diffusers' check must say."""
    import shutil

    from safetensors.torch import load_file, save_file

    layer = "transformer_blocks.0.attn.to_k"
    edits = {"missing": (lambda t: t.pop(f"{layer}.wcscales"), "Missing keys"),
             "unexpected": (lambda t: t.update({f"{layer}.smooth_factor_orig": t[f"{layer}.smooth_factor"].clone()}),
                            "Unexpected keys"),
             "dtype": (lambda t: t.update({f"{layer}.smooth_factor": t[f"{layer}.smooth_factor"].half()}),
                       f"{layer}.smooth_factor: stored torch.float16")}
    out = {}
    for name, (edit, phrase) in edits.items():
        copy = root / name
        shutil.copytree(folder, copy)
        tensors = load_file(copy / "diffusion_pytorch_model.safetensors")
        edit(tensors)
        save_file(tensors, copy / "diffusion_pytorch_model.safetensors")
        out[copy] = phrase
    return out


def test_another_writers_layers_are_requantized_by_name(tmp_path, capsys):
    fx = write_svdq_file(tmp_path / "src", "flux2", "nvfp4")  # per-tensor scales of out_proj and mlp_fc2 differ
    run = run_port(capsys, "convert", fx.path, "--layout", "diffusers", "--out", tmp_path / "lite", "--json")
    assert run.code == 0, run.err
    requantized = json.loads(run.out)["layout"]["requantized"]
    assert [r["layer"] for r in requantized] == ["single_transformer_blocks.0.attn.to_out"]
    assert "per-tensor scales" in requantized[0]["why"] and 0 < requantized[0]["rel_error"] < 0.2
    lite = write_lite_folder(tmp_path / "lite-src", "flux2", "int4")  # to_q, to_k, to_v each smoothed alone
    run = run_port(capsys, "convert", lite.path, "--layout", "nunchaku", "--out", tmp_path / "nun", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)["layout"]
    names = {r["layer"] for r in doc["requantized"]}
    assert {"transformer_blocks.0.attn.to_qkv", "transformer_blocks.0.attn.to_added_qkv"} <= names
    assert all("smoothing" in r["why"] for r in doc["requantized"])
    assert doc["tensors_identical"] > 0  # the rest read back bit for bit (checked as it is written)


def test_layout_refusals(own, tmp_path, capsys):
    plain = tmp_path / "plain.safetensors"
    save_state(plain, reference_model(TINY2, seed=1).state_dict(), torch.bfloat16)
    run = run_port(capsys, "convert", plain, "--layout", "diffusers", "--out", tmp_path / "a")
    assert run.code == 2 and "not an SVDQuant model" in run.err and "--quantize svdq-int4" in run.err
    svdq = own["flux2", "int4"]["nunchaku"]
    run = run_port(capsys, "convert", svdq, "--layout", "nunchaku", "--out", tmp_path / "b")
    assert run.code == 2 and "already in that layout" in run.err
    run = run_port(capsys, "convert", svdq, "--layout", "diffusers", "--to", "original", "--out", tmp_path / "c")
    assert run.code == 2 and "--to original" in run.err
    run = run_port(capsys, "convert", svdq, "--layout", "comfy", "--out", tmp_path / "d")
    assert run.code == 2
    assert not any((tmp_path / n).exists() for n in "abcd")


def _lora(view: dict[str, torch.Tensor], path: Path) -> Path:
    from .lorakit import BY_NAME, make_parts, write_adapter

    shapes = {k[: -len(".weight")]: tuple(v.shape) for k, v in view.items() if k.endswith(".weight") and v.ndim == 2}
    parts = make_parts(shapes, ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_out"], "lora",
                       seed=2, rank=4, alpha=None)
    return write_adapter(path, BY_NAME["peft-transformer"], parts, dtype=torch.bfloat16)


def test_merge_into_a_diffusers_layout_folder(own, tmp_path, capsys):
    """A LoRA appended to the branches of diffusers' layout: the same weights as merging into Nunchaku's file."""
    paths = own["flux2", "int4"]
    adapter = _lora(_readings(paths["to-diffusers"]), tmp_path / "lora.safetensors")
    for name in ("to-diffusers", "nunchaku"):
        run = run_port(capsys, "merge", paths[name], adapter, "--out", tmp_path / name)
        assert run.code == 0, run.err
    merged = tmp_path / "to-diffusers"
    assert (merged / "diffusion_pytorch_model.safetensors").is_file()
    a = _readings(merged)
    b = _readings(next((tmp_path / "nunchaku").glob("*.safetensors")))
    assert set(a) == set(b)
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=float(b[key].float().abs().max()) * 2**-7)
    rank = json.loads((merged / "config.json").read_text())["quantization_config"]["svdq_w4a4"]["rank"]
    assert rank > 64  # the branches grew, and config.json says so (diffusers sizes proj_* from it)


@pytest.mark.slow  # three merges and a child interpreter importing diffusers: ~7 s
def test_merged_and_requantized_folders_are_diffusers(own, tmp_path, capsys):
    paths = own["flux2", "int4"]
    adapter = _lora(_readings(paths["to-diffusers"]), tmp_path / "lora.safetensors")
    for name, extra in (("merged", ()), ("requantized", ("--requantize",))):
        run = run_port(capsys, "merge", paths["to-diffusers"], adapter, *extra, "--out", tmp_path / name)
        assert run.code == 0, run.err
    configs = [json.loads((folder / "config.json").read_text())["quantization_config"]["svdq_w4a4"]
               for folder in (paths["to-diffusers"], tmp_path / "requantized")]
    assert configs[1]["rank"] == configs[0]["rank"]  # the rank asked for, not the joined layers' sum again
    verdicts = check_with_diffusers([tmp_path / "merged", tmp_path / "requantized"], tmp_path)
    assert all(v["errors"] == [] for v in verdicts.values()), verdicts


def test_layout_refusal_and_inspect_import_no_torch(tmp_path, tiny2_file):
    """--layout where it does not apply is refused from the headers, before torch; inspecting diffusers' layout
    reads its config and headers only."""
    from .test_cli_startup import _loaded_after

    loaded = _loaded_after(["convert", str(tiny2_file), "--layout", "diffusers", "--out", str(tmp_path / "o")])
    assert loaded["heavy"] == [] and not (tmp_path / "o").exists()
    lite = write_lite_folder(tmp_path, "flux2", "int4")
    assert _loaded_after(["inspect", str(lite.path), "--json"])["heavy"] == []


def _verdicts(capsys, path: Path) -> dict[str, dict]:
    run = run_port(capsys, "inspect", path, "--json")
    assert run.code == 0, run.err
    return {v["runtime"]: v for v in json.loads(run.out)["compatibility"]}


def test_inspect_names_who_loads_a_4bit_model(own, tmp_path, capsys):
    """Nunchaku's FLUX.1 loaders, tonera's FLUX.2 runtime, ComfyUI-nunchaku and diffusers' Nunchaku Lite, each
    with a verdict and, where it needs one, the command that converts; the command given works."""
    klein = _verdicts(capsys, own["flux2", "int4"]["nunchaku"])
    assert klein["Nunchaku FLUX.2 (tonera's runtime)"]["status"] == "loads as is"
    assert klein["ComfyUI-nunchaku"]["status"] == "loads as is"
    assert klein["Nunchaku FLUX.1 (v1 / v2 loaders)"]["status"] == "not at all"
    lite = klein["diffusers Nunchaku Lite"]
    assert lite["status"] == "after port convert" and "--layout diffusers" in lite["command"]
    folder = _verdicts(capsys, own["flux2", "int4"]["to-diffusers"])
    assert folder["diffusers Nunchaku Lite"]["status"] == "loads as is"
    for runtime in ("Nunchaku FLUX.2 (tonera's runtime)", "ComfyUI-nunchaku"):
        assert folder[runtime]["status"] == "after port convert" and "--layout nunchaku" in folder[runtime]["command"]
    flux1 = _verdicts(capsys, own["flux1", "nvfp4"]["nunchaku"])
    assert flux1["Nunchaku FLUX.1 (v1 / v2 loaders)"]["status"] == "loads as is"
    assert flux1["Nunchaku FLUX.2 (tonera's runtime)"]["status"] == "not at all"
    alias = write_svdq_file(tmp_path / "alias", "flux2", "int4", spelling="alias")
    tonera = _verdicts(capsys, alias.path)["Nunchaku FLUX.2 (tonera's runtime)"]
    assert tonera["status"] == "after port convert" and "module names" in tonera["detail"]
    plain = tmp_path / "plain.safetensors"
    save_state(plain, reference_model(TINY2, seed=1).state_dict(), torch.bfloat16)
    assert "diffusers Nunchaku Lite" not in _verdicts(capsys, plain)  # asked of SVDQuant models only
    # the command inspect gives, run as given (its --out made absolute here)
    argv = lite["command"].split()[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "as-given")
    run = run_port(capsys, *argv)
    assert run.code == 0, run.err
    assert _verdicts(capsys, tmp_path / "as-given")["diffusers Nunchaku Lite"]["status"] == "loads as is"
