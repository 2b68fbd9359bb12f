"""FLUX.1 [dev] / [schnell] and FLUX.2 [dev] beside klein in the pipeline verbs: the tiny offline bases load in their
real pipelines, a converted BFL fine-tune publishes onto them into a folder `FluxPipeline` / `Flux2Pipeline` loads,
and generate, compare and bench run it. The families' pipeline facts come from the registry (no class names in the
verbs): a base whose text encoder does not fit the transformer is refused by name."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from porting.demo.bases import tiny_base, write_tiny_base
from porting.demo.tiny import write_random_checkpoint
from porting.engine.convert import convert
from porting.errors import CheckFailed
from porting.families import pipeline_variants
from porting.pipeline.generate import PNG_SOFTWARE, default_steps, generate, read_model_index
from porting.pipeline.publish import publish
from tests.helpers import run_port


def _port(root: Path, variant: str) -> dict[str, Path]:
    """A variant's tiny base, a random BFL-named fine-tune converted against it, and the published folder
    (--skip-validation: validating FLUX.1 is the staged runner's tests' job)."""
    tiny = tiny_base(variant)
    base = write_tiny_base(root / variant / "base", variant, seed=0)
    src = write_random_checkpoint(root / variant / "ft.safetensors", tiny.transformer, seed=1, table=tiny.family)
    converted = convert(src, root / variant / "transformer", strict=True, config=base)
    published = publish(base, converted.out, root / variant / "published", skip_validation=True)
    assert published.variant == variant  # inferred from the base's class and the transformer's guidance
    return {"base": base, "transformer": converted.out, "published": published.out}


class _Ports(dict):
    """Each variant's port, built the first time a test asks for it."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, variant: str) -> dict[str, Path]:
        self[variant] = _port(self.root, variant)
        return self[variant]


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> _Ports:
    return _Ports(tmp_path_factory.mktemp("families"))


def _pipeline(folder: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("variant", [pytest.param("flux1-dev"), pytest.param("dev"),
                                     pytest.param("flux1-schnell", marks=pytest.mark.slow)])
def test_published_folder_loads_in_its_pipeline_and_fits_its_base(ports, variant) -> None:
    import diffusers

    family, spec = pipeline_variants()[variant]
    base, published = ports[variant]["base"], ports[variant]["published"]
    index = read_model_index(published)
    assert index["_class_name"] == spec.pipeline
    for component, cls in spec.text_encoders.items():  # CLIP + T5 for FLUX.1, Mistral3 for FLUX.2 [dev]
        assert read_model_index(base)[component][1] == cls and (published / component).is_dir()
    pipe = getattr(diffusers, spec.pipeline).from_pretrained(published, local_files_only=True)
    assert type(pipe.transformer).__name__ == family.diffusers_class
    assert bool(pipe.transformer.config.guidance_embeds) == spec.guidance_embeds
    config = json.loads((published / "transformer" / "config.json").read_text())
    assert family.pipeline_fit(base, config, spec) == []
    card = (published / "README.md").read_text()
    assert "Not validated" in card and f"from diffusers import {spec.pipeline}" in card
    # the published folder's default steps are its variant's: 28 FLUX.1 [dev], 4 [schnell], 50 FLUX.2 [dev]
    assert default_steps(index, published) == spec.default_steps == {"flux1-dev": 28, "flux1-schnell": 4,
                                                                      "dev": 50}[variant]


@pytest.mark.parametrize("variant", [pytest.param("flux1-dev"), pytest.param("dev", marks=pytest.mark.slow)])
def test_generate_writes_a_png(ports, variant, tmp_path) -> None:
    image = tmp_path / "out.png"
    g = generate(ports[variant]["published"], "a red fox in the snow", device="cpu", steps=1, size=32, seed=3,
                 output=image, progress=False)
    assert g.pipeline == pipeline_variants()[variant][1].pipeline and g.steps == 1
    with Image.open(image) as png:
        assert png.size == (32, 32) and png.info.get("Software") == PNG_SOFTWARE
        pixels = np.asarray(png)
    # the same call through the pipeline itself gives the same picture: generate adds nothing of its own
    pipe = _pipeline(ports[variant]["published"])
    direct = pipe(prompt="a red fox in the snow", height=32, width=32, num_inference_steps=1,
                  generator=torch.Generator("cpu").manual_seed(3)).images[0]
    assert np.array_equal(np.asarray(direct), pixels)


@pytest.mark.slow
def test_flux1_dev_guidance_reaches_the_transformer(ports, tmp_path) -> None:
    """--guidance-scale is FLUX.1 [dev]'s embedded guidance: another scale, another image."""
    images = []
    for scale in (1.0, 8.0):
        out = tmp_path / f"g{scale}.png"
        generate(ports["flux1-dev"]["published"], "a red fox", device="cpu", steps=1, size=32, output=out,
                 guidance_scale=scale, progress=False)
        with Image.open(out) as png:
            images.append(np.asarray(png).astype(int))
    assert np.abs(images[0] - images[1]).max() > 0


def test_generate_refuses_a_reference_image_for_a_text_only_pipeline(ports, capsys, tmp_path) -> None:
    """FluxPipeline's signature has no `image`: refused by name (exit 2) before anything loads or is written."""
    ref = tmp_path / "ref.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(ref)
    started = time.perf_counter()
    run = run_port(capsys, "generate", ports["flux1-dev"]["published"], "--prompt", "x", "--image", ref,
                   "--output", tmp_path / "x.png")
    assert run.code == 2 and "--image: FluxPipeline takes no reference image" in run.msg
    assert not (tmp_path / "x.png").exists() and time.perf_counter() - started < 10


def test_publish_refuses_a_base_whose_text_encoders_do_not_fit(ports, tmp_path) -> None:
    """The family's pipeline_fit: T5's d_model must be joint_attention_dim and CLIP's width pooled_projection_dim;
    a FLUX.1 transformer on a FLUX.2 base is refused for the pipeline class and the text encoders."""
    base = tmp_path / "base"
    shutil.copytree(ports["flux1-dev"]["base"], base)
    for component, field in (("text_encoder_2", "d_model"), ("text_encoder", "hidden_size")):
        path = base / component / "config.json"
        cfg = json.loads(path.read_text())
        cfg[field] += 8
        path.write_text(json.dumps(cfg))
    with pytest.raises(CheckFailed) as err:
        publish(base, ports["flux1-dev"]["transformer"], tmp_path / "out", skip_validation=True)
    assert "T5 d_model d_model 40" in err.value.details and "joint_attention_dim is 32" in err.value.details
    assert "CLIP width hidden_size 32" in err.value.details and "pooled_projection_dim is 24" in err.value.details
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckFailed) as err:
        publish(ports["dev"]["base"], ports["flux1-dev"]["transformer"], tmp_path / "out2", skip_validation=True,
                variant="flux1-dev")
    assert "text_encoder_2 is None, FluxPipeline needs 'T5EncoderModel'" in err.value.details
    assert "text_encoder is 'Mistral3ForConditionalGeneration'" in err.value.details


@pytest.mark.slow
def test_compare_runs_flux1_with_pooled_embeddings(ports, tmp_path) -> None:
    """compare encodes once with the reference's CLIP + T5 and hands both embeddings (sequence and pooled) to the
    candidate, which loads no text encoder: the same folder on both sides gives identical images."""
    from validation.image_compare import Side, compare

    folder = ports["flux1-schnell"]["published"]
    result = compare(Side(folder, None, "cpu", None), Side(folder, None, "cpu", None), prompts=["a red fox"],
                     size=32, out=tmp_path / "cmp")
    doc = result.doc
    assert result.passed and doc["settings"]["steps"] == 4  # schnell's default
    assert doc["reference"]["pipeline"] == doc["candidate"]["pipeline"] == "FluxPipeline"
    assert doc["metrics"]["psnr"]["capped"] == 1  # identical pixels


@pytest.mark.slow
def test_compare_and_bench_run_flux2_dev(ports, tmp_path) -> None:
    from porting.pipeline.bench import bench
    from validation.image_compare import Side, compare

    folder = ports["dev"]["published"]
    result = compare(Side(ports["dev"]["base"], None, "cpu", None), Side(folder, None, "cpu", None),
                     prompts=["a red fox"], steps=2, size=32, out=tmp_path / "cmp")
    assert result.doc["candidate"]["pipeline"] == "Flux2Pipeline"
    assert result.doc["metrics"]["psnr"]["capped"] == 0  # the random fine-tune is not the base
    b = bench(folder, steps=1, runs=1, warmup=0, size=32, modes=["none"], out=tmp_path / "bench")
    rows = {r["task"]: r for r in json.loads((b.out / "bench.json").read_text())["rows"]}
    assert rows["t2i"]["status"] == "ok" and rows["edit"]["status"] == "ok"  # Flux2Pipeline takes an image


@pytest.mark.slow
def test_bench_skips_edit_for_flux1(ports, tmp_path) -> None:
    from porting.pipeline.bench import bench

    b = bench(ports["flux1-dev"]["published"], steps=1, runs=1, warmup=0, size=32, modes=["none"],
              out=tmp_path / "bench")
    rows = {r["task"]: r for r in json.loads((b.out / "bench.json").read_text())["rows"]}
    assert rows["t2i"]["status"] == "ok"
    assert rows["edit"]["status"] == "skipped" and "FluxPipeline takes no reference image" in rows["edit"]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline", [("flux1", "FluxPipeline"), ("flux2-dev", "Flux2Pipeline")])
def test_demo_runs_offline_for_the_family(family, pipeline, capsys, tmp_path) -> None:
    """`port demo --family`: convert, validate (PASS, the real gate), publish and generate on the family's tiny
    base."""
    work = tmp_path / "demo"
    run = run_port(capsys, "demo", "--workdir", work, "--family", family, "--json")
    assert run.code == 0, run.msg
    doc = json.loads(run.out)
    assert doc["family"] == family and doc["validate"]["verdict"] == "pass"
    assert doc["publish"]["pipeline"] == pipeline and doc["publish"]["validation"]["status"] == "pass"
    assert json.loads((work / "published" / "model_index.json").read_text())["_class_name"] == pipeline
    with Image.open(work / "demo.png") as image:
        assert image.size == (64, 64)


def test_demo_refuses_an_unknown_family(capsys, tmp_path) -> None:
    run = run_port(capsys, "demo", "--workdir", tmp_path / "demo", "--family", "flux3")
    families = "klein, klein-wide, flux1, flux1-schnell, flux2-dev"
    assert run.code == 2 and f"--family 'flux3': choose one of {families}" in run.msg
    assert not (tmp_path / "demo").exists()
