"""port generate: a published tiny port run on CPU, bit-identical to the same pipeline assembled in memory."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import in_memory_image  # noqa: E402

from porting.cli.app import main  # noqa: E402
from porting.errors import DeviceError, InputError, PortError  # noqa: E402
from porting.pipeline.generate import default_steps, generate, parse_size  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402


@pytest.fixture(scope="module")
def folders(port: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen")
    publish(port["base"], port["transformer"], root / "klein", report=port["pass"])
    publish(port["base"], port["transformer"], root / "kv", report=port["pass"], variant="klein-kv")
    return {"klein": root / "klein", "kv": root / "kv"}


@pytest.fixture(scope="module")
def reference_png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "ref.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


def test_generated_png_matches_in_memory_pipeline(port: dict, folders: dict, tmp_path: Path) -> None:
    from diffusers import Flux2KleinPipeline

    result = generate(folders["klein"], "a red fox in the snow", steps=2, seed=3, size=32,
                      output=tmp_path / "fox.png", progress=False)
    got = np.array(Image.open(tmp_path / "fox.png"))
    want = in_memory_image(Flux2KleinPipeline, port["transformer"], seed=3, prompt="a red fox in the snow",
                           height=32, width=32, num_inference_steps=2)
    assert got.shape == (32, 32, 3) and np.array_equal(got, want)
    assert result.pipeline == "Flux2KleinPipeline" and result.steps == 2 and result.dtype == "fp32"
    assert result.denoise_s > 0 and result.s_per_it == pytest.approx(result.denoise_s / 2, abs=1e-3)
    assert result.peak_memory_kind == "process RSS" and result.peak_memory_bytes > 10**7


def test_kv_edit_with_reference_image_matches_in_memory(port: dict, folders: dict, tmp_path: Path,
                                                       reference_png: Path) -> None:
    from diffusers import Flux2KleinKVPipeline

    result = generate(folders["kv"], "make it winter", steps=2, seed=5, size="32x48", images=[reference_png],
                      output=tmp_path / "edit.png", progress=False)
    got = np.array(Image.open(tmp_path / "edit.png"))
    want = in_memory_image(Flux2KleinKVPipeline, port["transformer"], seed=5, prompt="make it winter",
                           image=Image.open(reference_png).convert("RGB"), height=48, width=32,
                           num_inference_steps=2)
    assert got.shape == (48, 32, 3) and np.array_equal(got, want)
    assert result.pipeline == "Flux2KleinKVPipeline" and result.reference_images == [str(reference_png)]


def test_default_steps_follow_the_folder() -> None:
    # distilled klein (is_distilled true) and the KV pipeline default to 4 steps; base and dev models to 50
    assert default_steps({"_class_name": "Flux2KleinPipeline", "is_distilled": True}) == 4
    assert default_steps({"_class_name": "Flux2KleinKVPipeline"}) == 4
    assert default_steps({"_class_name": "Flux2KleinPipeline"}) == 50
    assert default_steps({"_class_name": "Flux2Pipeline"}) == 50


def test_cli_generate_prints_timings(folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["generate", str(folders["klein"]), "--prompt", "a fox", "--steps", "1", "--size", "16",
                              "--output", str(tmp_path / "f.png"), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert {"load_s", "denoise_s", "s_per_it", "peak_memory_bytes", "peak_memory_kind"} <= set(doc)
    assert Path(doc["output"]).is_file()
    code, out, err = run_cli(["generate", str(folders["klein"]), "--prompt", "a fox", "--steps", "1", "--size", "16",
                              "--output", str(tmp_path / "g.png")], capsys)
    assert code == 0 and "s/it" in out and "peak memory" in out


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_without_torch_npu_is_a_clear_error(folders: dict, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["generate", str(folders["klein"]), "--prompt", "x", "--device", "npu:0",
                              "--output", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "torch_npu" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"cpu_offload": "model"}, PortError, "needs --device cuda or npu"),  # offloading to the CPU itself
    ({"size": 30}, PortError, "multiples of 4"),                          # tiny VAE: 2 x 2 patches of 2 px
    ({"size": "big"}, PortError, "WIDTHxHEIGHT"),
    ({"output": "x.jpg"}, PortError, "PNG"),
    ({"device": "tpu"}, DeviceError, "Unknown device"),
])
def test_bad_arguments(folders: dict, tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    kwargs.setdefault("output", tmp_path / "x.png")
    with pytest.raises(error, match=match):
        generate(folders["klein"], "x", steps=1, **{"size": 16, **kwargs})


def test_small_reference_image_is_refused(folders: dict, tmp_path: Path) -> None:
    small = tmp_path / "small.png"
    Image.new("RGB", (32, 64)).save(small)
    with pytest.raises(InputError, match="at least 64 px"):
        generate(folders["kv"], "x", steps=1, size=16, images=[small], output=tmp_path / "x.png")


def test_not_a_pipeline_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no model_index.json"):
        generate(tmp_path, "x", output=tmp_path / "x.png")


def test_parse_size() -> None:
    assert parse_size(1024) == (1024, 1024)
    assert parse_size("768x1024") == (768, 1024)
