"""port validate for every family with stages: FLUX.1 [dev] / [schnell] (FluxTransformer2DModel) and FLUX.2 [dev] /
[klein] (Flux2Transformer2DModel).

Oracles: the staged golden equals the diffusers model's own forward on a converted folder (float32), and for FLUX.1
the inputs are the ones FluxPipeline feeds its transformer (its first step, captured with a hook). A fault injected
into one block of the device run is located in that block.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from porting.demo.tiny import write_random_checkpoint
from porting.engine.convert import convert
from porting.families import get_family
from validation.api import validate
from validation.inputs import build_inputs
from validation.staged import StagedModel
from validation.weights import WeightSource

from .helpers import run_port

SMALL = dict(resolution=128, text_len=32, timesteps=(1.0, 0.4))  # 64 image + 32 text tokens, 2 timesteps
CLI_SMALL = ["--resolution", "128", "--text-len", "32", "--timesteps", "1.0,0.4"]
FLUX1, FLUX2 = get_family("flux1"), get_family("flux2")
MODELS = {  # name: (family, config)
    "flux1-dev": (FLUX1, {**FLUX1.tiny_config, "guidance_embeds": True}),
    "flux1-schnell": (FLUX1, {**FLUX1.tiny_config, "guidance_embeds": False}),
    "flux2-dev": (FLUX2, {**FLUX2.tiny_config, "guidance_embeds": True}),
    "flux2-klein": (FLUX2, {**FLUX2.tiny_config, "guidance_embeds": False}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each model as a BFL-named file (what a fine-tune ships)."""
    root = tmp_path_factory.mktemp("families")
    return {name: write_random_checkpoint(root / f"{name}.safetensors", config, table=family.name, seed=5)
            for name, (family, config) in MODELS.items()}


def _whole_forward(folder: Path, s: dict) -> torch.Tensor:
    """The diffusers model loaded from a converted folder, called as the pipelines call it."""
    import diffusers

    cls_name = json.loads((folder / "config.json").read_text())["_class_name"]
    model = getattr(diffusers, cls_name).from_pretrained(folder, torch_dtype=torch.float32).eval()
    extra = {"pooled_projections": s["pooled"]} if "pooled" in s else {}
    with torch.no_grad():
        return model(hidden_states=s["x"], encoder_hidden_states=s["ctx"], timestep=s["timestep"],
                     img_ids=s["img_ids"], txt_ids=s["txt_ids"], guidance=s.get("guidance"), **extra).sample


@pytest.mark.parametrize("name", list(MODELS))
def test_the_staged_golden_equals_the_diffusers_forward(name, checkpoints, tmp_path) -> None:
    family, config = MODELS[name]
    folder = tmp_path / "transformer"
    convert(checkpoints[name], folder)
    source = WeightSource(checkpoints[name])  # the original-named file, mapped on the fly
    assert source.detection.family is family and source.config["guidance_embeds"] == config["guidance_embeds"]
    inputs = build_inputs(source.config, **SMALL)
    assert ("guidance" in inputs.state) == config["guidance_embeds"]
    staged = StagedModel(source, torch.device("cpu"), torch.float32)
    streamed = staged.forward_all(inputs.state)
    assert all(p.device.type == "meta" for p in staged.model.parameters())  # every stage released its weights
    torch.testing.assert_close(streamed, _whole_forward(folder, inputs.state), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name,variant", [("flux1-dev", "flux1-dev"), ("flux2-dev", "dev")])
def test_inputs_are_what_the_pipeline_feeds_its_transformer(name, variant, checkpoints, tmp_path) -> None:
    """The family's pipeline (a tiny base, our converted transformer), first step at sigma 1 (timestep 1.0 after its
    / 1000, its default guidance) on our latents and text features: the transformer receives our ids, timestep and
    guidance, and computes what the staged run computes."""
    import diffusers

    from porting.demo.bases import write_tiny_base

    folder = tmp_path / "transformer"
    convert(checkpoints[name], folder)
    source = WeightSource(folder)
    inputs = build_inputs(source.config, resolution=128, text_len=32, timesteps=(1.0,))
    s = inputs.state
    base = write_tiny_base(tmp_path / "base", variant, seed=0)
    cls = getattr(diffusers, source.detection.table.diffusers_class)
    transformer = cls.from_pretrained(folder, torch_dtype=torch.float32).eval()
    seen: dict = {}
    transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    transformer.register_forward_hook(lambda m, a, o: seen.update(out=o[0] if isinstance(o, tuple) else o.sample))
    pipe = diffusers.DiffusionPipeline.from_pretrained(base, transformer=transformer, local_files_only=True)
    side = 128 // 16  # image tokens per side; the tiny base's VAE downsamples less than the real one's 8
    size = side * 2 * pipe.vae_scale_factor
    if "pooled" in s:  # FluxPipeline takes packed latents
        pipe(prompt_embeds=s["ctx"], pooled_prompt_embeds=s["pooled"], latents=s["x"], height=size, width=size,
             num_inference_steps=1, output_type="latent")
    else:  # Flux2Pipeline packs (B, C, H, W) latents itself
        latents = s["x"].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        pipe(prompt_embeds=s["ctx"], latents=latents, height=size, width=size, num_inference_steps=1,
             output_type="latent")
    assert torch.equal(seen["timestep"], s["timestep"]) and torch.equal(seen["guidance"], s["guidance"])
    assert torch.equal(seen["img_ids"], s["img_ids"]) and torch.equal(seen["txt_ids"], s["txt_ids"])
    assert torch.equal(seen["hidden_states"], s["x"])
    if "pooled" in s:
        assert torch.equal(seen["pooled_projections"], s["pooled"])
    streamed = StagedModel(source, torch.device("cpu"), torch.float32).forward_all(s)
    torch.testing.assert_close(streamed, seen["out"], rtol=0, atol=1e-6)


def test_flux1_dev_validates_pass_through_the_cli(checkpoints, capsys, tmp_path) -> None:
    run = run_port(capsys, "validate", checkpoints["flux1-dev"], "--json", "--out", tmp_path / "r", *CLI_SMALL)
    assert run.code == 0, run.err
    d = json.loads(run.out)
    assert d["verdict"] == "pass" and d["blame"] is None
    assert d["inputs"]["guidance"] == 3.5 and d["model"]["naming"] == "original"
    assert [b["stage"] for b in d["blocks"]] == ["embed", "transformer_blocks.0", "transformer_blocks.1",
                                                 "single_transformer_blocks.0", "single_transformer_blocks.1",
                                                 "final"]
    assert [b["original"] for b in d["blocks"]] == ["img_in, txt_in, time_in, vector_in, guidance_in",
                                                    "double_blocks.0", "double_blocks.1", "single_blocks.0",
                                                    "single_blocks.1", "final_layer"]
    assert json.loads((tmp_path / "r" / "report.json").read_text())["verdict"] == "pass"


@pytest.mark.parametrize("name", ["flux1-schnell", "flux2-dev"])
def test_schnell_and_flux2_dev_validate_pass(name, checkpoints) -> None:
    d = validate(checkpoints[name], **SMALL).to_dict()
    assert d["verdict"] == "pass" and d["blame"] is None and len(d["blocks"]) == 6
    assert ("guidance" in d["inputs"]) == MODELS[name][1]["guidance_embeds"]
    assert 0 < d["output"]["intrinsic"]["rel_l2"] < 0.05  # bf16 against a float32 golden: a real, small error


def _perturb(key_to_break: str, scale: float, key: str, t: torch.Tensor) -> torch.Tensor:
    if key != key_to_break:
        return t
    g = torch.Generator().manual_seed(0)
    return t + scale * t.float().std() * torch.randn(t.shape, generator=g).to(t.dtype)


def _noise(key_to_break: str, scale: float):
    """A device-side weight fault (a partial of a module-level function: spawned ranks receive it pickled)."""
    return functools.partial(_perturb, key_to_break, scale)


@pytest.mark.parametrize("key,stage,original", [
    ("transformer_blocks.1.ff.net.0.proj.weight", "transformer_blocks.1", "double_blocks.1"),
    ("single_transformer_blocks.0.proj_mlp.weight", "single_transformer_blocks.0", "single_blocks.0"),
])
def test_a_fault_in_one_flux1_block_is_located_in_that_block(key, stage, original, checkpoints) -> None:
    d = validate(checkpoints["flux1-dev"], device_weight_transform=_noise(key, 0.1), **SMALL).to_dict()
    assert d["verdict"] == "fail"
    assert d["blame"]["stage"] == stage and d["blame"]["original"] == original
    before = [b for b in d["blocks"][:[b["stage"] for b in d["blocks"]].index(stage)]]
    assert before and all(b["teacher_forced"]["ratio"] <= 2.0 for b in before)  # blocks before the fault are clean


@pytest.mark.slow  # two spawned ranks: a few seconds of start-up each
def test_flux1_on_two_cpu_ranks_equals_one_process(checkpoints, tmp_path) -> None:
    fault = _noise("single_transformer_blocks.1.proj_mlp.weight", 0.1)
    one = validate(checkpoints["flux1-dev"], device_weight_transform=fault, **SMALL).to_dict()
    two = validate(checkpoints["flux1-dev"], devices="cpu,cpu", device_weight_transform=fault, **SMALL).to_dict()
    assert two["blocks"] == one["blocks"] and two["verdict"] == "fail"
    assert two["blame"]["stage"] == "single_transformer_blocks.1"


@pytest.mark.parametrize("variant,pipeline_class", [("flux1-dev", "FluxPipeline"), ("dev", "Flux2Pipeline")])
def test_a_prompt_is_encoded_by_the_bases_own_pipeline_encoders(variant, pipeline_class, tmp_path) -> None:
    """--base --prompt: the features equal what the base's pipeline (loaded from the folder) computes itself."""
    import diffusers

    from porting.demo.bases import tiny_base, write_tiny_base

    tb = tiny_base(variant)
    base = write_tiny_base(tmp_path / "base", variant, seed=0)
    ft = write_random_checkpoint(tmp_path / "ft.safetensors", tb.transformer, table=tb.family, seed=1)
    inputs = build_inputs(WeightSource(ft).config, resolution=64, text_len=16, timesteps=(1.0,), base=base,
                          prompt="a red fox")
    assert inputs.description["text_features"] == "prompt"
    pipe = getattr(diffusers, pipeline_class).from_pretrained(base, transformer=None, vae=None, local_files_only=True)
    with torch.no_grad():
        want = pipe.encode_prompt("a red fox", device=torch.device("cpu"), max_sequence_length=16)
    torch.testing.assert_close(inputs.state["ctx"], want[0].float(), rtol=0, atol=0)
    if pipeline_class == "FluxPipeline":  # CLIP's pooled output too; and the whole run once (the same for both)
        torch.testing.assert_close(inputs.state["pooled"], want[1].float(), rtol=0, atol=0)
        d = validate(ft, resolution=64, text_len=16, timesteps=(1.0,), base=base, prompt="a red fox").to_dict()
        assert d["verdict"] == "pass" and d["inputs"]["prompt"] == "a red fox"


def test_a_prompt_needs_the_bases_second_encoder_for_flux1(tmp_path) -> None:
    import shutil

    from porting.demo.bases import tiny_base, write_tiny_base
    from porting.errors import InputError

    base = write_tiny_base(tmp_path / "base", "flux1-dev", seed=0)
    shutil.rmtree(base / "text_encoder_2")
    ft = write_random_checkpoint(tmp_path / "ft.safetensors", tiny_base("flux1-dev").transformer, table="flux1")
    with pytest.raises(InputError, match="text_encoder_2/"):
        build_inputs(WeightSource(ft).config, resolution=64, text_len=16, base=base, prompt="a fox")


def test_the_memory_estimate_groups_weights_by_the_familys_blocks(checkpoints) -> None:
    from porting.resources import stage_params

    source = WeightSource(checkpoints["flux1-dev"])
    assert source.stage_of("single_transformer_blocks.1.proj_mlp.weight") == "single_transformer_blocks.1"
    assert source.stage_of("time_text_embed.guidance_embedder.linear_1.weight") == "other"
    shapes = [(k, tuple(s)) for k, s, _ in source.plan.outputs()]
    staged = StagedModel(source, torch.device("cpu"), torch.float32)
    per_stage = [sum(p.numel() for _, m in staged._modules(n) for p in m.parameters()) for n in staged.stage_names()]
    blocks = max(per_stage[1:-1])
    assert stage_params(shapes, source.stage_of) == max(blocks, per_stage[0] + per_stage[-1])
    assert source.text_encoders(Path("base"), "a fox") == [Path("base/text_encoder"), Path("base/text_encoder_2")]
