"""port compare on the tiny published pipeline: metrics against independent computations, identity, a fault caught.

PSNR and SSIM are checked against numpy implementations written from their definitions (SSIM: Wang et al. 2004 with
torchmetrics' window: Gaussian 11 x 11, sigma 1.5, reflect padding); LPIPS against the formula of Zhang et al. 2018
around an injected random AlexNet-shaped backbone (no download: the network is blocked in this module).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from porting.errors import PortError  # noqa: E402
from porting.pipeline.generate import generate  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from tests.helpers import run_cli  # noqa: E402
from validation import image_metrics as im  # noqa: E402
from validation.image_compare import (  # noqa: E402
    Side,
    assign_seeds,
    builtin_prompts,
    compare,
    parse_prompts,
    read_prompts,
    seed_for,
)

PROMPTS = ["a red fox in the snow", "a neon street at night"]
FAST = ["--steps", "2", "--size", "32"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Any connection attempt fails the test; the torch hub cache is an empty folder unless a test fills it."""
    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))



@pytest.fixture(scope="module")
def folder(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "klein"
    publish(port["base"], port["transformer"], out, report=port["pass"])
    return out


@pytest.fixture(scope="module")
def backbone_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random AlexNet backbone saved as torchvision names it (features.N.*, plus a classifier to be ignored)."""
    torch.manual_seed(11)
    state = {f"features.{k}": v for k, v in im.alexnet_features().state_dict().items()}
    state["classifier.1.weight"] = torch.zeros(4, 4)
    path = tmp_path_factory.mktemp("alex") / "alexnet-random.pth"
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def noisy_transformer(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The port's transformer with Gaussian noise (half the weights' spread) in one block's attention output."""
    from diffusers import Flux2Transformer2DModel

    model = Flux2Transformer2DModel.from_pretrained(port["transformer"], torch_dtype=torch.float32)
    weight = dict(model.named_parameters())["transformer_blocks.0.attn.to_out.0.weight"]
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * weight.std() * 0.5)
    out = tmp_path_factory.mktemp("noisy") / "transformer"
    model.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# independent metric implementations

def numpy_psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(1.0 / mse))


def numpy_ssim(a: np.ndarray, b: np.ndarray, sigma: float = 1.5, radius: int = 5) -> float:
    """Mean SSIM over channels and pixels; a, b: H x W x C in [0, 1]."""
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    g = np.exp(-(x / sigma) ** 2 / 2)
    g /= g.sum()

    def blur(img: np.ndarray) -> np.ndarray:  # separable Gaussian, 'valid' after reflect padding
        p = np.pad(img, ((radius, radius), (radius, radius)), mode="reflect")
        rows = np.stack([np.convolve(r, g, mode="valid") for r in p])
        return np.stack([np.convolve(c, g, mode="valid") for c in rows.T]).T

    c1, c2 = 0.01**2, 0.03**2
    maps = []
    for ch in range(a.shape[2]):
        x1, x2 = a[..., ch].astype(np.float64), b[..., ch].astype(np.float64)
        m1, m2 = blur(x1), blur(x2)
        v1 = np.maximum(blur(x1 * x1) - m1**2, 0)
        v2 = np.maximum(blur(x2 * x2) - m2**2, 0)
        cov = blur(x1 * x2) - m1 * m2
        maps.append(((2 * m1 * m2 + c1) * (2 * cov + c2)) / ((m1**2 + m2**2 + c1) * (v1 + v2 + c2)))
    return float(np.mean(maps))


def known_images() -> tuple[np.ndarray, np.ndarray]:
    """A smooth colour picture (48 x 40) and a copy with a bright square and mild noise."""
    y, x = np.mgrid[0:40, 0:48]
    a = np.stack([x / 47, y / 39, 0.5 + 0.4 * np.sin(x / 5.0) * np.cos(y / 7.0)], axis=-1)
    b = a + np.random.default_rng(3).normal(0, 0.03, a.shape)
    b[10:20, 12:24] += 0.2
    return (np.clip(a, 0, 1) * 255).round().astype(np.uint8), (np.clip(b, 0, 1) * 255).round().astype(np.uint8)


def formula_lpips(features: torch.nn.Sequential, a: np.ndarray, b: np.ndarray) -> float:
    """LPIPS (Zhang et al. 2018) written out: inputs to [-1, 1], the fixed ImageNet scaling, activations after the
    five ReLUs of AlexNet unit-normalised over channels, squared differences weighted by the learned 1x1 heads
    (torchmetrics' shipped alex.pth), averaged over space and summed over layers."""
    import torchmetrics

    heads = torch.load(Path(torchmetrics.__file__).parent / "functional/image/lpips_models/alex.pth",
                       map_location="cpu", weights_only=True)
    shift = np.array([-0.030, -0.088, -0.188])[None, :, None, None]
    scale = np.array([0.458, 0.448, 0.450])[None, :, None, None]

    def taps(img: np.ndarray) -> list[np.ndarray]:
        t = (2 * img.astype(np.float64) / 255 - 1).transpose(2, 0, 1)[None]
        h = torch.from_numpy((t - shift) / scale).float()
        out = []
        with torch.no_grad():
            for i, layer in enumerate(features):
                h = layer(h)
                if i in (1, 4, 7, 9, 11):
                    out.append(h.double().numpy())
        return out

    total = 0.0
    for k, (fa, fb) in enumerate(zip(taps(a), taps(b))):
        na = fa / np.sqrt(1e-8 + (fa**2).sum(axis=1, keepdims=True))
        nb = fb / np.sqrt(1e-8 + (fb**2).sum(axis=1, keepdims=True))
        w = heads[f"lin{k}.model.1.weight"].double().numpy().reshape(1, -1, 1, 1)
        total += float(((na - nb) ** 2 * w).sum(axis=1).mean())
    return total


# ---------------------------------------------------------------------------------------------------------------
# metrics

def test_psnr_and_ssim_match_independent_numpy() -> None:
    a, b = known_images()
    ta, tb = im.to_tensor(a), im.to_tensor(b)
    value, capped = im.psnr(tb, ta)
    assert not capped and value == pytest.approx(numpy_psnr(a / 255, b / 255), abs=1e-3)
    assert im.ssim(tb, ta) == pytest.approx(numpy_ssim(a / 255, b / 255), abs=1e-4)
    assert 0.3 < im.ssim(tb, ta) < 0.99  # a real difference, not a degenerate value
    assert im.psnr(ta, ta) == (im.PSNR_CAP_DB, True)  # infinite PSNR is capped and flagged
    assert im.ssim(ta, ta) == pytest.approx(1.0, abs=1e-6)


def test_lpips_through_an_injected_backbone_matches_the_formula(backbone_file: Path) -> None:
    a, b = known_images()
    a, b = np.asarray(Image.fromarray(a).resize((64, 64))), np.asarray(Image.fromarray(b).resize((64, 64)))
    features = im.load_backbone(backbone_file)
    scorer = im.LpipsScorer(features)
    got = scorer(im.to_tensor(b), im.to_tensor(a))
    assert got > 0 and got == pytest.approx(formula_lpips(features, b, a), rel=1e-4)
    assert scorer(im.to_tensor(a), im.to_tensor(a)) == 0.0
    # the same backbone through the file path (torchvision key names, classifier ignored) gives the same number
    assert im.LpipsScorer.from_file(backbone_file)(im.to_tensor(b), im.to_tensor(a)) == pytest.approx(got, rel=1e-6)


def test_lpips_backbone_comes_from_the_hub_cache_or_is_unavailable(backbone_file: Path, tmp_path: Path) -> None:
    missing = im.find_backbone()
    assert not missing.available and str(im.hub_checkpoint_path()) in missing.reason
    assert not im.hub_checkpoint_path().exists()  # nothing was fetched into the cache
    im.hub_checkpoint_path().parent.mkdir(parents=True)
    os.link(backbone_file, im.hub_checkpoint_path())
    assert im.find_backbone().path == im.hub_checkpoint_path()
    with pytest.raises(PortError, match="no such file"):
        im.find_backbone(tmp_path / "nope.pth")
    bad = tmp_path / "bad.pth"
    torch.save({"features.0.weight": torch.zeros(1)}, bad)
    with pytest.raises(PortError, match="not AlexNet weights"):
        im.load_backbone(bad)


# ---------------------------------------------------------------------------------------------------------------
# the verb

def test_compare_of_a_folder_with_itself_is_identical(folder: Path, backbone_file: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "self"
    code, stdout, err = run_cli(["compare", str(folder), str(folder), "-p", PROMPTS[0], "-p", PROMPTS[1], *FAST,
                                 "--out", str(out), "--lpips-weights", str(backbone_file), "--min-psnr", "60",
                                 "--max-lpips", "0.001", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)  # exactly one JSON document
    assert doc == {**json.loads((out / "compare.json").read_text()), "out": str(out)}
    s = doc["summary"]
    assert s["psnr"] == {"mean": 100.0, "p50": 100.0, "p90": 100.0} and doc["metrics"]["psnr"]["capped"] == 2
    assert s["ssim"]["mean"] == pytest.approx(1.0) and s["lpips"] == {"mean": 0.0, "p50": 0.0, "p90": 0.0}
    assert doc["gates"]["passed"] and doc["reference"]["weights_sha256"] == doc["candidate"]["weights_sha256"]
    for row, prompt in zip(doc["images"], PROMPTS):
        assert row["prompt"] == prompt and row["seed"] == seed_for(prompt) and row["psnr_capped"]
        assert np.array_equal(np.asarray(Image.open(out / row["reference"])),
                              np.asarray(Image.open(out / row["candidate"])))
    grid = Image.open(out / doc["grid"])
    grid.load()
    assert grid.width > 3 * 32 and grid.height > 2 * 32  # three columns, two rows
    assert "capped at 100 dB" in (out / "compare.md").read_text()


def test_reference_images_are_what_generate_makes(folder: Path, tmp_path: Path) -> None:
    """The shared text embeddings and the explicit CPU noise change nothing: the reference PNG is the image
    `port generate` makes from the same prompt, seed and steps."""
    result = compare(Side(folder), Side(folder), prompts=[PROMPTS[0]], seeds=[7], steps=2, size=32,
                     out=tmp_path / "c")
    generate(folder, PROMPTS[0], steps=2, seed=7, size=32, output=tmp_path / "g.png", progress=False)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "c" / "reference" / "000.png")),
                          np.asarray(Image.open(tmp_path / "g.png")))
    lp = result.doc["metrics"]["lpips"]
    assert result.doc["summary"]["lpips"] is None and not lp["available"] and "--lpips-weights" in lp["reason"]
    assert all(row["lpips"] is None for row in result.doc["images"])


def test_edit_comparison_on_the_kv_pipeline(port: dict, tmp_path: Path) -> None:
    """--image passes a reference image on both sides (the KV pipeline's cached path); the reference side is
    again exactly what `port generate --image` makes."""
    kv = tmp_path / "kv"
    publish(port["base"], port["transformer"], kv, report=port["pass"], variant="klein-kv")
    picture = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(picture)
    result = compare(Side(kv), Side(kv), prompts=["make it winter"], seeds=[5], steps=2, size=32, images=[picture],
                     out=tmp_path / "c")
    generate(kv, "make it winter", steps=2, seed=5, size=32, images=[picture], output=tmp_path / "g.png",
             progress=False)
    got = np.asarray(Image.open(tmp_path / "c" / "reference" / "000.png"))
    assert np.array_equal(got, np.asarray(Image.open(tmp_path / "g.png")))
    assert result.doc["reference"]["pipeline"] == "Flux2KleinKVPipeline" and result.doc["settings"]["images"] == [
        str(picture)]
    assert result.doc["summary"]["psnr"]["mean"] == 100.0


def test_noise_in_one_block_is_caught_by_the_gates(folder: Path, noisy_transformer: Path, backbone_file: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "noisy"
    code, stdout, err = run_cli(["compare", str(folder), str(folder), "--candidate-transformer",
                                 str(noisy_transformer), "-p", PROMPTS[0], "-p", PROMPTS[1], *FAST, "--out", str(out),
                                 "--lpips-weights", str(backbone_file), "--min-psnr", "60", "--max-lpips", "0.0001",
                                 "--json"], capsys)
    assert code == 1, err
    doc = json.loads(stdout)  # one document, the comparison, saying why it failed
    assert doc["exit_code"] == 1 and not doc["gates"]["passed"] and len(doc["gates"]["failures"]) == 2
    assert "below --min-psnr 60" in doc["error"] and "Traceback" not in err
    assert doc["candidate"]["transformer_swapped"] and doc["candidate"]["weights_sha256"] != \
        doc["reference"]["weights_sha256"]
    assert 20 < doc["summary"]["psnr"]["mean"] < 60 and doc["summary"]["lpips"]["mean"] > 0.0001
    assert (out / "compare.json").is_file() and (out / "grid.png").is_file()  # the evidence is kept


def test_lpips_gate_without_a_backbone_stops_before_rendering(folder: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    code, stdout, err = run_cli(["compare", str(folder), str(folder), "-p", "x", *FAST, "--out",
                                 str(tmp_path / "o"), "--max-lpips", "0.1"], capsys)
    assert code == 2 and "LPIPS" in err and "--lpips-weights" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_without_a_backbone_compare_warns_in_one_short_line(folder: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """No --lpips-weights and an empty hub cache: one line (at most 80 columns) that names the missing file and the
    option; compare.json keeps LPIPS unavailable with the full reason (the folder searched) and that line."""
    code, stdout, err = run_cli(["compare", str(folder), str(folder), "-p", "x", "--steps", "1", "--size", "32",
                                 "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "LPIPS" in line]
    assert lines == ["Warning: LPIPS skipped: no alexnet-owt-7be5be79.pth; pass --lpips-weights FILE"], err
    assert len(lines[0]) <= 80
    lp = json.loads((tmp_path / "o" / "compare.json").read_text())["metrics"]["lpips"]
    assert not lp["available"] and str(im.hub_checkpoint_path()) in lp["reason"]
    assert lp["warning"] == lines[0].removeprefix("Warning: ")


def test_images_below_lpips_minimum_name_the_size_that_fixes_it(backbone_file: Path) -> None:
    from validation.image_compare import lpips_scorer

    scorer, missing = lpips_scorer(None, backbone_file, 16, 16)
    assert scorer is None and "below LPIPS' 32 px minimum" in missing.reason
    assert missing.warning == "LPIPS skipped: 16x16 images, under 32 px; pass --size 32 or more"


def test_existing_out_is_refused_before_any_work(folder: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    code, stdout, err = run_cli(["compare", str(folder), str(folder), "-p", "x", *FAST, "--out", str(tmp_path / "o"),
                                 "--json"], capsys)
    assert code == 2 and "already exists" in json.loads(stdout)["error"] and "--force" in err
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"


def test_prompts_and_seeds(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("# my prompts\na cat\n\nthe sea at night\n")
    assert read_prompts(tmp_path / "p.txt") == ["a cat", "the sea at night"]
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(PortError, match="no prompts"):
        read_prompts(tmp_path / "empty.txt")
    prompts = builtin_prompts()
    assert len(prompts) >= 24 and len(set(prompts)) == len(prompts)
    assert parse_prompts("# comment\n\n a cat \nthe sea\n") == ["a cat", "the sea"]
    assert assign_seeds(["a", "b"], None) == [seed_for("a"), seed_for("b")] and seed_for("a") != seed_for("b")
    assert assign_seeds(["a", "b"], [5]) == [5, 5] and assign_seeds(["a", "b"], [1, 2]) == [1, 2]
    with pytest.raises(PortError, match="2 seeds for 3 prompts"):
        assign_seeds(["a", "b", "c"], [1, 2])
