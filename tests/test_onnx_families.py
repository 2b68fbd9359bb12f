"""port export --format onnx for every family: FLUX.1 [dev]/[schnell] and FLUX.2 [dev] beside klein.

The oracle is the diffusers model itself (transformer, VAE decoder, text encoders) run in torch float32 on inputs
of sizes the export never traced with; the onnxruntime validation of a FLUX.1 export is shown to fail on an export
whose external-data bytes were edited. What each family exports comes from the family (`Family.export_module`);
the Ryzen AI flow refuses what its family does not declare for it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from porting.cli.app import main  # noqa: E402
from porting.demo.bases import write_tiny_base  # noqa: E402
from porting.errors import InputError, PortError  # noqa: E402
from porting.export.lint import lint  # noqa: E402
from porting.export.onnx import MANIFEST, export_onnx, model_spec  # noqa: E402
from porting.export.ort import open_session  # noqa: E402
from porting.families import get_family  # noqa: E402
from porting.families.flux1 import TINY as TINY_FLUX1  # noqa: E402
from porting.families.flux2 import TINY as TINY_FLUX2  # noqa: E402

SMALL = dict(resolution=64, text_len=16)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def _transformer_folder(folder: Path, cls_name: str, config: dict, seed: int = 0) -> Path:
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, cls_name)(**{k: v for k, v in config.items() if not k.startswith("_")})
    model.save_pretrained(folder)
    return folder


def _flux1_feed(batch: int, side: int, text: int, guidance: bool) -> dict[str, torch.Tensor]:
    """FluxPipeline's transformer inputs: ids are one (tokens, 3) table for the whole batch."""
    from diffusers import FluxPipeline

    gen = torch.Generator().manual_seed(batch + side)
    feed = {"hidden_states": torch.randn(batch, side * side, TINY_FLUX1["in_channels"], generator=gen),
            "encoder_hidden_states": torch.randn(batch, text, TINY_FLUX1["joint_attention_dim"], generator=gen),
            "pooled_projections": torch.randn(batch, TINY_FLUX1["pooled_projection_dim"], generator=gen),
            "timestep": torch.rand(batch, generator=gen),
            "img_ids": FluxPipeline._prepare_latent_image_ids(batch, side, side, "cpu", torch.float32),
            "txt_ids": torch.zeros(text, 3)}
    if guidance:
        feed["guidance"] = torch.full((batch,), 3.5)
    return feed


def _flux2_feed(batch: int, side: int, text: int, guidance: bool) -> dict[str, torch.Tensor]:
    from diffusers import Flux2KleinPipeline

    gen = torch.Generator().manual_seed(batch + side)
    ctx = torch.randn(batch, text, TINY_FLUX2["joint_attention_dim"], generator=gen)
    feed = {"hidden_states": torch.randn(batch, side * side, TINY_FLUX2["in_channels"], generator=gen),
            "encoder_hidden_states": ctx, "timestep": torch.rand(batch, generator=gen),
            "img_ids": Flux2KleinPipeline._prepare_latent_ids(torch.empty(batch, 1, side, side)),
            "txt_ids": Flux2KleinPipeline._prepare_text_ids(ctx)}
    if guidance:
        feed["guidance"] = torch.full((batch,), 4.0)
    return feed


def _ort_equals_torch(export: Path, folder: Path, cls_name: str, feeds: list[dict[str, torch.Tensor]]) -> float:
    import diffusers

    model = getattr(diffusers, cls_name).from_pretrained(folder, dtype=torch.float32).eval()
    session = open_session(export)
    assert [i.name for i in session.get_inputs()] == list(feeds[0])  # the diffusers forward's names, in order
    worst = 0.0
    for feed in feeds:
        with torch.no_grad():
            want = model(**feed, return_dict=False)[0].numpy()
        (got,) = session.run(None, {k: v.numpy() for k, v in feed.items()})
        assert got.shape == want.shape
        worst = max(worst, _rel(got, want))
    return worst


# ---------------------------------------------------------------- fast: what the families declare, refusals

def test_each_family_declares_its_components() -> None:
    flux1, flux2 = get_family("flux1"), get_family("flux2")
    dev1 = flux1.export_spec({**TINY_FLUX1, "guidance_embeds": True}, "FluxPipeline")
    schnell = flux1.export_spec({**TINY_FLUX1, "guidance_embeds": False}, "FluxPipeline")
    assert (dev1.title, schnell.title) == ("FLUX.1 [dev]", "FLUX.1 [schnell]")
    assert list(dev1.components) == ["transformer", "vae_decoder", "text_encoder", "text_encoder_2"]
    assert dev1.copied == ("tokenizer", "tokenizer_2", "scheduler") and not dev1.ryzenai
    klein = flux2.export_spec(TINY_FLUX2, "Flux2KleinPipeline")
    dev2 = flux2.export_spec({**TINY_FLUX2, "guidance_embeds": True}, "Flux2Pipeline")
    assert (klein.title, klein.ryzenai) == ("FLUX.2 [klein]", True)
    assert (dev2.title, dev2.ryzenai) == ("FLUX.2 [dev]", False)
    assert flux2.export_spec({**TINY_FLUX2, "guidance_embeds": True}).title == "FLUX.2 [dev]"  # a lone transformer


def test_flux1_transformer_graph_takes_pooled_projections_and_guidance(tmp_path) -> None:
    """The traced module and its example inputs (no export): FluxPipeline's names, FLUX.1's unbatched ids."""
    for guidance in (True, False):
        folder = _transformer_folder(tmp_path / str(guidance), "FluxTransformer2DModel",
                                     {**TINY_FLUX1, "num_layers": 1, "num_single_layers": 1,
                                      "guidance_embeds": guidance})
        spec, family, cls_name = model_spec(folder / "config.json")
        traced = spec.components["transformer"].load(folder, torch.float32)
        assert (family, cls_name) == ("flux1", "FluxTransformer2DModel")
        assert traced.inputs == ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                                 "img_ids", "txt_ids"] + (["guidance"] if guidance else [])
        assert traced.dynamic["img_ids"] == {0: "image_tokens"} and traced.example["img_ids"].shape[1] == 3
        with torch.no_grad():
            assert traced.module(**traced.example).shape == traced.example["hidden_states"].shape


@pytest.mark.parametrize("cls_name, config, title", [
    ("FluxTransformer2DModel", {**TINY_FLUX1, "num_layers": 1, "num_single_layers": 1}, "FLUX.1 [dev]"),
    ("Flux2Transformer2DModel", {**TINY_FLUX2, "num_layers": 1, "num_single_layers": 1, "guidance_embeds": True},
     "FLUX.2 [dev]")])
def test_ryzenai_refuses_what_its_family_does_not_declare(tmp_path, capsys, cls_name, config, title) -> None:
    folder = _transformer_folder(tmp_path / "transformer", cls_name, config)
    code, _, err = run_cli(["export", str(folder), "--format", "onnx", "--target", "ryzenai", "--size", "32",
                            "--text-len", "8", "--out", str(tmp_path / "x")], capsys)
    assert code == 2, err
    assert title in err and cls_name in err and "Ryzen AI flow is written for FLUX.2 [klein]" in err
    assert "Traceback" not in err and not (tmp_path / "x").exists()


def test_an_unknown_transformer_class_is_refused_naming_it(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(InputError, match="SD3Transformer2DModel.*knows no family"):
        export_onnx(tmp_path, tmp_path.parent / "x")


def test_a_component_the_family_does_not_have_is_named(tmp_path) -> None:
    folder = _transformer_folder(tmp_path / "t", "FluxTransformer2DModel", {**TINY_FLUX1, "num_layers": 1})
    with pytest.raises(PortError, match="text_encoder_3: unknown for FLUX.1 \\[dev\\].*text_encoder_2"):
        export_onnx(folder, tmp_path / "x", components=["text_encoder_3"])


# ---------------------------------------------------------------- whole tiny pipelines (slow: minutes of tracing)

@pytest.fixture(scope="module")
def flux1_dev(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny FLUX.1 [dev] base (FluxPipeline: CLIP + T5) exported whole through the CLI."""
    root = tmp_path_factory.mktemp("flux1-dev")
    base = write_tiny_base(root / "base", "flux1-dev", seed=0)
    with pytest.raises(SystemExit) as exc:
        main(["export", str(base), "--format", "onnx", "--out", str(root / "onnx"), "--quiet"])
    assert exc.value.code in (0, None)
    return base, root / "onnx"


@pytest.mark.slow
def test_flux1_dev_pipeline_export_layout_and_every_component_equals_torch(flux1_dev, capsys) -> None:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, T5EncoderModel

    base, out = flux1_dev
    manifest = json.loads((out / MANIFEST).read_text())
    assert sorted(manifest["components"]) == ["text_encoder", "text_encoder_2", "transformer", "vae_decoder"]
    assert manifest["copied"] == ["tokenizer", "tokenizer_2", "scheduler"] and manifest["model"] == "FLUX.1 [dev]"
    assert manifest["components"]["transformer"]["inputs"][2] == "pooled_projections"
    feeds = [_flux1_feed(2, 5, 9, True)]
    assert _ort_equals_torch(out / "transformer", base / "transformer", "FluxTransformer2DModel", feeds) < 1e-5
    clip = CLIPTextModel.from_pretrained(base / "text_encoder").eval()
    t5 = T5EncoderModel.from_pretrained(base / "text_encoder_2").eval()
    vae = AutoencoderKL.from_pretrained(base / "vae").eval()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, clip.config.vocab_size, (3, 77), generator=gen)
    ids[:, -1] = clip.config.eos_token_id  # the pooled row is the end-of-text token's
    ids2 = torch.randint(0, t5.config.vocab_size, (3, 40), generator=gen)
    z = torch.randn(1, vae.config.latent_channels, 7, 9, generator=gen)
    with torch.no_grad():
        wants = {"text_encoder": clip(input_ids=ids).pooler_output, "text_encoder_2": t5(input_ids=ids2)[0],
                 "vae_decoder": vae.decode(z, return_dict=False)[0]}
    feeds2 = {"text_encoder": {"input_ids": ids}, "text_encoder_2": {"input_ids": ids2},
              "vae_decoder": {"latent_sample": z}}
    for name, want in wants.items():
        (got,) = open_session(out / name).run(None, {k: v.numpy() for k, v in feeds2[name].items()})
        assert got.shape == tuple(want.shape) and _rel(got, want.numpy()) < 1e-5, name
    code, stdout, _ = run_cli(["export", "--check", str(out), "--target", "generic"], capsys)
    assert code == 0 and "PASS" in stdout


@pytest.mark.slow
def test_flux1_onnx_validates_on_onnxruntime_and_an_edited_weight_fails(flux1_dev, tmp_path) -> None:
    from test_onnx import _perturb_external_tensor

    from validation.api import validate

    _, out = flux1_dev
    d = validate(out / "transformer", runtime="onnxruntime", **SMALL).to_dict()
    assert d["verdict"] == "pass", d["reasons"]
    assert 0 < d["output"]["device"]["rel_l2"] < 1e-4 and d["device"] == "onnxruntime:CPUExecutionProvider"
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    name = _perturb_external_tensor(broken / "transformer", "single_transformer_blocks.0.proj_mlp.weight", 0.5)
    assert "single_transformer_blocks.0" in name
    d = validate(broken / "transformer", runtime="onnxruntime", **SMALL).to_dict()
    assert d["verdict"] == "fail" and d["output"]["ratio"] > 10


@pytest.mark.slow
def test_flux1_generate_runs_the_onnx_transformer_and_draws_the_same_image(flux1_dev, tmp_path) -> None:
    from PIL import Image

    from porting.pipeline.generate import generate

    base, out = flux1_dev
    result = generate(out, "a red fox", steps=2, seed=3, size=32, output=tmp_path / "onnx.png", progress=False)
    generate(base, "a red fox", steps=2, seed=3, size=32, output=tmp_path / "torch.png", progress=False)
    got = np.asarray(Image.open(tmp_path / "onnx.png"), dtype=np.int16)
    want = np.asarray(Image.open(tmp_path / "torch.png"), dtype=np.int16)
    assert result.transformer_runtime == "onnxruntime:CPUExecutionProvider"
    assert got.shape == (32, 32, 3) and got.std() > 1 and np.abs(got - want).max() <= 1


@pytest.mark.slow
def test_flux1_schnell_lone_transformer_folder_exports(tmp_path, capsys) -> None:
    base = write_tiny_base(tmp_path / "base", "flux1-schnell", seed=1)
    code, _, err = run_cli(["export", str(base / "transformer"), "--format", "onnx", "--out", str(tmp_path / "o"),
                            "--quiet"], capsys)
    assert code == 0, err
    manifest = json.loads((tmp_path / "o" / MANIFEST).read_text())
    assert (manifest["family"], manifest["model"], manifest["class_name"]) == ("flux1", "FLUX.1 [schnell]",
                                                                              "FluxTransformer2DModel")
    assert manifest["source"]["layout"] == "transformer" and manifest["copied"] == []
    assert "guidance" not in manifest["components"]["transformer"]["inputs"]
    feeds = [_flux1_feed(1, 3, 5, False), _flux1_feed(3, 6, 11, False)]  # batch 1 and sizes the trace never saw
    assert _ort_equals_torch(tmp_path / "o" / "transformer", base / "transformer", "FluxTransformer2DModel",
                             feeds) < 1e-5
    assert lint(tmp_path / "o", "generic").ok


@pytest.mark.slow
def test_flux2_dev_pipeline_export_with_its_mistral_text_encoder(tmp_path, capsys) -> None:
    from transformers import Mistral3ForConditionalGeneration

    base = write_tiny_base(tmp_path / "base", "dev", seed=0)
    code, _, err = run_cli(["export", str(base), "--format", "onnx", "--out", str(tmp_path / "o"),
                            "--components", "transformer,text_encoder", "--quiet"], capsys)
    assert code == 0, err
    out = tmp_path / "o"
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["model"] == "FLUX.2 [dev]" and manifest["components"]["transformer"]["inputs"][-1] == "guidance"
    feeds = [_flux2_feed(2, 5, 9, True)]
    assert _ort_equals_torch(out / "transformer", base / "transformer", "Flux2Transformer2DModel", feeds) < 1e-5
    layers = manifest["components"]["text_encoder"]["hidden_states_layers"]
    encoder = Mistral3ForConditionalGeneration.from_pretrained(base / "text_encoder").eval()
    n = encoder.config.text_config.num_hidden_layers
    assert len(layers) == 3 and layers == sorted(layers) and max(layers) <= n  # (10, 20, 30) at this depth
    ids = torch.randint(0, encoder.config.text_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row, as the pipeline pads to max_length
    with torch.no_grad():
        hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    want = torch.stack([hidden[k] for k in layers], dim=1).permute(0, 2, 1, 3).reshape(2, 12, -1).numpy()
    (got,) = open_session(out / "text_encoder").run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    assert got.shape == want.shape and _rel(got, want) < 1e-5
    assert lint(out, "generic").ok
