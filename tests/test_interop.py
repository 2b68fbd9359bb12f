"""Issue 18: files ComfyUI saves go in, one original-naming file comes out, pipeline folders are arguments,
inspect says which runtime loads a file, and merge drops adapter keys only when told to.

ComfyUI's saved spelling is built from ComfyUI's rule (targets-and-scale.md section 1): the `model.diffusion_model.`
prefix, and every RMSNorm scale renamed `.scale` -> `.weight` on load and never renamed back on save. The converted
model is held against the BFL reference forward, FLUX.1 and FLUX.2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel
from safetensors import safe_open

from porting.tensors.reader import Checkpoint  # noqa: F401  (the reader whose keys are respelled)

from . import lorakit
from . import quantfiles as qf
from .helpers import (
    REAL2,
    TINY1_DEV,
    TINY2,
    compare_outputs,
    meta_shapes,
    reference_model,
    run_port,
    save_state,
    write_header_only,
)
from .reference.flux2_bfl import Flux2Reference
from .test_equivalence import (
    TOL,
    flux1_inputs,
    flux2_inputs,
    load_strict,
    run_flux1_pair,
    run_flux2_pair,
)

COMFY = "model.diffusion_model."


def comfy_saved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as ComfyUI's ModelSave writes it."""
    def respell(key: str) -> str:
        for norm in ("query_norm", "key_norm"):
            key = key.replace(f".{norm}.scale", f".{norm}.weight")
        return COMFY + key
    return {respell(k): v for k, v in state.items()}


def bf16_rounded(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def test_comfyui_saved_flux2_bf16_converts_to_the_reference_output(tmp_path, capsys):
    reference = bf16_rounded(reference_model(TINY2, seed=3))
    saved = comfy_saved(reference.state_dict())
    assert sum(k.endswith("_norm.weight") for k in saved) == 2 * (2 * 2 + 2)  # q and k, img and txt, single
    src = save_state(tmp_path / "comfy-saved.safetensors", saved, torch.bfloat16)
    run = run_port(capsys, "inspect", src, "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["prefix"] == COMFY and doc["spelling"]["saved_by"] == "ComfyUI" and doc["spelling"]["respelled"] == 12
    run = run_port(capsys, "convert", src, "--out", tmp_path / "transformer", "--strict", "-q")
    assert run.code == 0, run.err
    model = load_strict(Flux2Transformer2DModel, tmp_path / "transformer")
    ref, out = run_flux2_pair(reference, model, flux2_inputs(TINY2))
    assert (ref - out).abs().max().item() <= TOL, compare_outputs(ref, out)


def test_comfyui_saved_flux1_converts_to_the_reference_output(tmp_path, capsys):
    reference = reference_model(TINY1_DEV, seed=4)
    src = save_state(tmp_path / "comfy-saved-flux1.safetensors", comfy_saved(reference.state_dict()))
    run = run_port(capsys, "convert", src, "--out", tmp_path / "transformer", "--strict", "-q")
    assert run.code == 0, run.err
    model = load_strict(FluxTransformer2DModel, tmp_path / "transformer")
    ref, out = run_flux1_pair(reference, model, flux1_inputs(TINY1_DEV))
    assert (ref - out).abs().max().item() <= TOL, compare_outputs(ref, out)


def test_comfyui_saved_comfy_quant_fp8_converts_to_the_producers_dequantization(tmp_path, capsys):
    state = reference_model(TINY2, seed=5).state_dict()
    tensors, oracle, meta = qf.comfy_mixed(state, "float8_e4m3fn")
    src = qf.save(tmp_path / "comfy-fp8.safetensors", comfy_saved(tensors), meta)
    out = tmp_path / "transformer"
    run = run_port(capsys, "convert", src, "--out", out, "--strict", "--dtype", "fp32", "-q", "--json")
    assert run.code == 0, run.err
    assert json.loads(run.out)["dequantized_from"].startswith("ComfyUI mixed precision")
    expected = Flux2Reference(TINY2)
    expected.load_state_dict(oracle, strict=True)
    ref, got = run_flux2_pair(expected.eval(), load_strict(Flux2Transformer2DModel, out), flux2_inputs(TINY2))
    assert (ref - got).norm() / ref.norm() < 1e-5


def test_original_output_keeps_bfls_scale_spelling(tmp_path, capsys):
    src = save_state(tmp_path / "comfy.safetensors", comfy_saved(reference_model(TINY2).state_dict()))
    run = run_port(capsys, "convert", src, "--to", "original", "--out", tmp_path / "orig", "-q")
    assert run.code == 0, run.err
    with safe_open(tmp_path / "orig" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert keys == set(reference_model(TINY2).state_dict())  # no prefix, `.scale` norms: BFL's own layout


# --- one file for original naming -------------------------------------------------------------------------------

def test_a_real_shape_klein_9b_to_original_is_planned_as_one_file_of_the_published_layout(tmp_path, capsys):
    published = meta_shapes(REAL2["klein-9B"])
    assert len(published) == 201
    bfl = write_header_only(tmp_path / "klein-9b.safetensors", published)
    plan = json.loads(run_port(capsys, "convert", bfl, "--dry-run", "--json").out)
    assert len(plan["planned_files"]) == 4  # diffusers output keeps its 5 GB shards (18.2 GB)
    # the diffusers layout the first plan would write, as a sharded folder
    folder = tmp_path / "diffusers"
    folder.mkdir()
    from porting.engine.convert import prepare

    _, _, p = prepare(bfl)
    write_header_only(folder / "diffusion_pytorch_model.safetensors", {k: s for k, s, _ in p.outputs()})
    run = run_port(capsys, "convert", folder, "--to", "original", "--dry-run", "--json")
    assert run.code == 0, run.err
    files = json.loads(run.out)["planned_files"]
    assert [f["name"] for f in files] == ["model.safetensors"] and files[0]["tensors"] == 201
    assert files[0]["bytes"] == 2 * sum(math.prod(s) for s in published.values()) > 18e9
    _, _, back = prepare(folder, to="original")
    assert {k: tuple(s) for k, s, _ in back.outputs()} == {k: tuple(s) for k, s in published.items()}


def test_max_shard_size_still_shards_original_naming_with_a_warning(tmp_path, capsys, tiny2_file):
    run = run_port(capsys, "convert", tiny2_file, "--to", "original", "--max-shard-size", "100KB",
                   "--out", tmp_path / "orig")
    assert run.code == 0, run.err
    assert "cannot load shards" in run.err and "ComfyUI" in run.err
    assert len(list((tmp_path / "orig").glob("model-*-of-*.safetensors"))) > 1
    run = run_port(capsys, "convert", tiny2_file, "--to", "original", "--out", tmp_path / "one", "-q")
    assert run.code == 0 and [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]


# --- a pipeline folder is a fine argument ---------------------------------------------------------------------------

def test_verbs_take_a_pipeline_folder_and_say_they_use_its_transformer(tmp_path, capsys, port):
    pipeline = port["base"]
    run = run_port(capsys, "inspect", pipeline)
    assert run.code == 0, run.err
    assert "pipeline folder (model_index.json): reading its transformer/" in run.err
    doc = _inspect(capsys, pipeline)
    assert doc["naming"] == "diffusers" and doc["path"] == str(pipeline / "transformer")
    run = run_port(capsys, "convert", pipeline, "--to", "original", "--out", tmp_path / "orig")
    assert run.code == 0, run.err
    assert "reading its transformer/" in run.err and (tmp_path / "orig" / "model.safetensors").is_file()


# --- which runtime loads this file ------------------------------------------------------------------------------------

def _status(doc: dict) -> dict[str, str]:
    return {v["runtime"]: v["status"] for v in doc["compatibility"]}


def _inspect(capsys, path: Path, *args) -> dict:
    run = run_port(capsys, "inspect", path, "--json", *args)
    assert run.code == 0, run.err
    return json.loads(run.out)


AS_IS, AFTER, NEVER, UNKNOWN = "loads as is", "after port convert", "not at all", "unknown"


def test_compatibility_of_each_kind_of_transformer_file(tmp_path, capsys):
    state = reference_model(TINY2, seed=5).state_dict()
    files = {
        "original": save_state(tmp_path / "bfl.safetensors", state),
        "comfy-prefix": save_state(tmp_path / "prefixed.safetensors", state, prefix=COMFY),
        "comfy-saved": save_state(tmp_path / "saved.safetensors", comfy_saved(state)),
        "fp8-scaled": qf.save(tmp_path / "scaled.safetensors", qf.comfy_scaled_fp8(state)[0]),
        "comfy_quant": qf.save(tmp_path / "mixed.safetensors", *qf.comfy_mixed(state, "float8_e4m3fn")[::2]),
        "bfl-fp8": qf.save(tmp_path / "bfl-fp8.safetensors", qf.bfl_fp8(state)[0]),
    }
    gguf = tmp_path / "model.gguf"
    qf.gguf_file(gguf, state, "Q8_0")
    files["gguf"] = gguf
    assert run_port(capsys, "convert", files["original"], "--out", tmp_path / "diffusers", "-q").code == 0
    files["diffusers"] = tmp_path / "diffusers"
    expected = {
        "original": (AFTER, AS_IS, AS_IS, AFTER, UNKNOWN),  # a tiny geometry: BFL builds the released ones
        "comfy-prefix": (AFTER, AFTER, AS_IS, AFTER, AFTER),
        "comfy-saved": (AFTER, AFTER, AS_IS, AFTER, AFTER),
        "fp8-scaled": (AFTER, AFTER, AS_IS, AFTER, AFTER),
        "comfy_quant": (AFTER, AFTER, AS_IS, AFTER, AFTER),
        "bfl-fp8": (AFTER, AS_IS, AFTER, AFTER, AFTER),
        "gguf": (AFTER, AS_IS, AFTER, AS_IS, AFTER),
        "diffusers": (AS_IS, AS_IS, AFTER, AFTER, AFTER),  # its one file: diffusers-named single files load too
    }
    runtimes = ["diffusers from_pretrained", "diffusers from_single_file", "ComfyUI (core)", "ComfyUI-GGUF",
                "BFL reference code"]
    for kind, path in files.items():
        doc = _inspect(capsys, path)
        assert _status(doc) == dict(zip(runtimes, expected[kind])), kind
        for v in doc["compatibility"]:  # every "after" names the exact command, and it names this file
            assert (v["command"] is not None) == (v["status"] in (AFTER, NEVER)), (kind, v)
            assert v["command"] is None or str(path) in v["command"], (kind, v)


@pytest.mark.parametrize("naming, expected", [
    ("kohya", (AFTER, AS_IS, AS_IS, NEVER)),
    ("peft-transformer", (AS_IS, UNKNOWN, UNKNOWN, NEVER)),  # it targets the global modulation (unsettled)
    ("peft-base_model", (AS_IS, AFTER, AFTER, NEVER)),  # ComfyUI maps no base_model.model. keys onto FLUX
    ("lycoris-lokr", (NEVER, UNKNOWN, UNKNOWN, NEVER)),
    ("bfl-lora_A", (AFTER, AS_IS, AS_IS, NEVER)),
    ("bfl-lokr", (NEVER, AS_IS, AS_IS, NEVER)),
])
def test_compatibility_of_each_kind_of_adapter(tmp_path, capsys, naming, expected):
    state = reference_model(TINY2, seed=5).state_dict()
    path, _ = lorakit.adapter_for(tmp_path / f"{naming}.safetensors", lorakit.BY_NAME[naming], state)
    doc = _inspect(capsys, path)
    assert tuple(v["status"] for v in doc["compatibility"]) == expected
    assert all(v["command"] for v in doc["compatibility"] if v["status"] in (AFTER, NEVER))
    assert all("not read" in v["detail"] for v in doc["compatibility"] if v["status"] == UNKNOWN)


def test_comfyui_loads_diffusers_naming_block_adapters_and_flux1_transformers(tmp_path, capsys):
    """Issue 30, item 8: verdicts from the loaders' code. comfy/lora.py maps `transformer.` / `lycoris_` keys of
    every FLUX block module, and comfy/model_detection.py converts a FLUX.1 diffusers transformer (it reads
    `x_embedder.bias`, which FLUX.2 lacks)."""
    state = reference_model(TINY2, seed=5).state_dict()
    blocks = [m for m in lorakit.DIFFUSERS_MODULES if m.startswith(("transformer_blocks", "single_transformer"))]
    for naming in ("peft-transformer", "lycoris-lokr", "kohya-loha"):
        path, _ = lorakit.adapter_for(tmp_path / f"{naming}.safetensors", lorakit.BY_NAME[naming], state,
                                      modules=blocks if lorakit.BY_NAME[naming].diffusers_modules else None)
        assert _status(_inspect(capsys, path))["ComfyUI (core)"] == AS_IS, naming
    flux1 = save_state(tmp_path / "flux1.safetensors", reference_model(TINY1_DEV, seed=4).state_dict())
    assert run_port(capsys, "convert", flux1, "--out", tmp_path / "flux1-diffusers", "-q").code == 0
    status = _status(_inspect(capsys, tmp_path / "flux1-diffusers"))
    assert status["ComfyUI (core)"] == AS_IS and status["BFL reference code"] == AFTER
    klein = _status(_inspect(capsys, save_state(tmp_path / "k.safetensors", state)))  # original naming
    assert klein["ComfyUI (core)"] == AS_IS


@pytest.mark.parametrize("variant, expected", [("FLUX.2-dev", AS_IS), ("klein-4B", UNKNOWN), ("klein-9B", UNKNOWN),
                                               ("custom", UNKNOWN), ("FLUX.1-dev", AS_IS)])
def test_bfl_reference_verdict_follows_the_code_that_was_read(variant, expected):
    """BFL's flux2 code read (ab7cca6) defines FLUX.2 [dev] only: klein is "unknown", not "loads as is"."""
    from porting.compat import Facts, bfl_reference

    family = "flux1" if variant.startswith("FLUX.1") else "flux2"
    facts = Facts(Path("m.safetensors"), family, "original", "", 0, 1, False, "safetensors", None, variant=variant)
    verdict = bfl_reference(facts)
    assert verdict.status == expected and (expected == AS_IS or "not read" in verdict.detail or "not traced" in
                                           verdict.detail)


def test_a_text_encoder_of_another_size_beside_the_transformer_is_named(tmp_path, capsys, port):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(port["base"], base)
    doc = _inspect(capsys, port["transformer"], "--base", base)
    assert all(row["ok"] for row in doc["companions"]["checks"]), doc["companions"]
    te = base / "text_encoder" / "config.json"
    cfg = json.loads(te.read_text())
    cfg["hidden_size"] = cfg["hidden_size"] * 2  # the text encoder of the larger model beside the smaller one
    te.write_text(json.dumps(cfg))
    doc = _inspect(capsys, port["transformer"], "--base", base)
    bad = [row for row in doc["companions"]["checks"] if not row["ok"]]
    assert [row["check"] for row in bad] == ["text encoder width"]
    assert f"hidden {cfg['hidden_size']} x 3 layers = {3 * cfg['hidden_size']}" in bad[0]["detail"]
    run = run_port(capsys, "inspect", port["transformer"], "--base", base)
    assert "MISMATCH" in run.out and "text encoder width" in run.out


# --- adapters with keys for modules the base lacks ------------------------------------------------------------------

def test_merge_skip_drops_named_keys_on_purpose_and_lists_them(tmp_path, capsys):
    state = reference_model(TINY2, seed=5).state_dict()
    base = save_state(tmp_path / "in" / "base.safetensors", state)
    naming = lorakit.BY_NAME["bfl-lora_A"]
    dev_state = reference_model(__import__("tests.helpers", fromlist=["TINY2_GUIDANCE"]).TINY2_GUIDANCE,
                                seed=5).state_dict()
    path, _ = lorakit.adapter_for(tmp_path / "in" / "dev-lora.safetensors", naming, dev_state,
                                  modules=lorakit.BFL_MODULES + ["guidance_in.in_layer"])
    run = run_port(capsys, "merge", base, path, "--out", tmp_path / "refused")
    assert run.code == 1 and "guidance_in.in_layer" in run.msg and not (tmp_path / "refused").exists()
    run = run_port(capsys, "merge", base, path, "--skip", "*guidance_in*", "--out", tmp_path / "merged")
    assert run.code == 0, run.err
    assert "skipped 2 key(s)" in run.err and "guidance_in.in_layer.lora_A.weight" in run.err
    manifest = json.loads((tmp_path / "merged" / "flux-port.json").read_text())
    assert manifest["merged_adapters"][0]["skipped"] == ["diffusion_model.guidance_in.in_layer.lora_A.weight",
                                                         "diffusion_model.guidance_in.in_layer.lora_B.weight"]
    run = run_port(capsys, "merge", base, path, "--skip", "nothing*", "--out", tmp_path / "x")
    assert run.code == 2 and "--skip 'nothing*': matches no key" in run.msg


def test_a_lora_for_another_model_width_is_refused_with_both_widths(tmp_path, capsys):
    from .helpers import Flux2Params

    wider = Flux2Params(**{**TINY2.__dict__, "hidden": 96, "heads": 3})
    base = save_state(tmp_path / "in" / "base.safetensors", reference_model(TINY2, seed=5).state_dict())
    path, _ = lorakit.adapter_for(tmp_path / "in" / "wide-lora.safetensors", lorakit.BY_NAME["kohya"],
                                  reference_model(wider, seed=5).state_dict())
    run = run_port(capsys, "merge", base, path, "--out", tmp_path / "out")
    assert run.code == 1, run.err
    assert "this adapter is 96 wide" in run.msg and "is 64 wide" in run.msg
    assert not (tmp_path / "out").exists()


def test_a_damaged_companion_config_is_exit_2_naming_the_file_and_field(tmp_path, capsys, port):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(port["base"], base)
    te = base / "text_encoder" / "config.json"
    te.write_text(json.dumps({**json.loads(te.read_text()), "hidden_size": "abc"}))
    (base / "model_index.json").write_text(json.dumps({**json.loads((base / "model_index.json").read_text()),
                                                       "_class_name": ["not", "a", "name"]}))
    run = run_port(capsys, "inspect", port["transformer"], "--base", base)
    assert run.code == 2 and "Traceback" not in run.err
    assert f"{te}: 'hidden_size' is 'abc'" in run.msg


def test_detect_leaves_the_checkpoint_it_is_given_as_it_was(tmp_path):
    """ComfyUI's spelling is read through a respelled view: the opened checkpoint keeps its stored keys, so one
    opened file can be detected twice (another base config, other tables) and reads the same both times."""
    from porting.inputs import open_source
    from porting.inputs.detect import detect

    saved = comfy_saved(reference_model(TINY2, seed=3).state_dict())
    source = open_source(save_state(tmp_path / "comfy-saved.safetensors", saved, torch.bfloat16))
    stored = list(source.view.tensors)
    first, second = detect(source.view), detect(source.view)
    assert list(source.view.tensors) == stored and sorted(stored) == sorted(saved)
    assert first.respelled == second.respelled and len(first.respelled) == 12
    assert list(first.ckpt.tensors) == list(second.ckpt.tensors) != stored
    old, new = next(iter(first.respelled.items()))
    assert torch.equal(first.ckpt.read(new), source.view.read(old))
