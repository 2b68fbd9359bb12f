"""port export --format onnx and validation on onnxruntime: the tiny klein port exported, run, judged and faulted.

The oracle for the export is the diffusers transformer itself (and the VAE decoder) at sizes the export never saw;
the validation is shown to fail on an export whose external-data bytes were edited.
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
from tinyport import build_tiny_port  # noqa: E402

from porting.cli.app import main  # noqa: E402
from porting.demo.tiny import REAL_FLUX2  # noqa: E402
from porting.errors import DeviceError, PortError  # noqa: E402
from porting.export.onnx import MANIFEST, check_fits, export_onnx  # noqa: E402
from porting.export.ort import open_session, require  # noqa: E402
from porting.outputs import RECORD
from porting.pipeline.generate import generate  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from porting.skeleton import diffusers_skeleton  # noqa: E402
from validation.api import validate  # noqa: E402
from validation.runners.base import Runner  # noqa: E402

SMALL = dict(resolution=128, text_len=32)  # 64 image + 32 text tokens, 3 timesteps
BROKEN_WEIGHT = "transformer_blocks.1.ff.linear_in.weight"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    port = build_tiny_port(tmp_path_factory.getbasetemp() / "tiny-port")
    folder = tmp_path_factory.mktemp("onnx-src") / "klein"
    publish(port["base"], port["transformer"], folder, report=port["pass"])
    return port, folder


@pytest.fixture(scope="module")
def fp32_export(published, tmp_path_factory) -> tuple[Path, dict]:
    """Through the CLI, as a user runs it: transformer and VAE decoder, fp32, default opset."""
    _, folder = published
    out = tmp_path_factory.mktemp("onnx") / "klein-onnx"
    with pytest.raises(SystemExit) as exc:
        main(["export", str(folder), "--format", "onnx", "--out", str(out), "--components",
              "transformer,vae_decoder", "--quiet"])
    assert exc.value.code in (0, None)
    return out, json.loads((out / MANIFEST).read_text())


@pytest.fixture(scope="module")
def fp16_export(published, tmp_path_factory) -> tuple[Path, object]:
    """Through the API, fp16 at the oldest opset the exporter writes (below it is refused, tests/test_safety_checks)."""
    _, folder = published
    out = tmp_path_factory.mktemp("onnx16") / "klein-onnx16"
    return out, export_onnx(folder, out, dtype="fp16", opset=18, components=["transformer"])


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
def test_export_layout_manifest_and_graph_interface(published, fp32_export) -> None:
    import onnx

    port, folder = published
    out, manifest = fp32_export
    assert sorted(p.name for p in out.iterdir()) == [RECORD, MANIFEST, "scheduler", "tokenizer", "transformer",
                                                     "vae_decoder"]  # RECORD: flux-port's ownership record
    assert manifest["source"]["weights_sha256"] == port["weights"]  # the weights the golden will run
    assert manifest["source"]["transformer"] == str((folder / "transformer").resolve())
    assert manifest["opset"] == {"requested": 18, "produced": 18} and manifest["dtype"] == "fp32"
    model = onnx.load(str(out / "transformer" / "model.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims == {"hidden_states": ["batch", "image_tokens", 16],
                    "encoder_hidden_states": ["batch", "text_tokens", 48], "timestep": ["batch"],
                    "img_ids": ["batch", "image_tokens", 4],
                    "txt_ids": ["batch", "text_tokens", 4]}
    big = [t for t in model.graph.initializer if np.prod(t.dims) >= 1024]
    assert big and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)
    assert f"model.{BROKEN_WEIGHT}" in {t.name for t in big}  # initializers keep the diffusers names
    assert (out / "transformer" / "model.onnx.data").stat().st_size > 4 * 100_000  # ~109 k fp32 parameters
    assert (out / "tokenizer" / "tokenizer_config.json").is_file()


@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
@pytest.mark.parametrize("batch, side, text", [(1, 4, 8), (3, 8, 40)])
def test_onnxruntime_equals_the_diffusers_transformer(published, fp32_export, batch, side, text) -> None:
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    _, folder = published
    out, _ = fp32_export
    model = Flux2Transformer2DModel.from_pretrained(folder / "transformer", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(batch)
    ctx = torch.randn(batch, text, 48, generator=gen)
    feed = {"hidden_states": torch.randn(batch, side * side, 16, generator=gen), "encoder_hidden_states": ctx,
            "timestep": torch.rand(batch, generator=gen),
            "img_ids": Flux2KleinPipeline._prepare_latent_ids(torch.empty(batch, 1, side, side)),
            "txt_ids": Flux2KleinPipeline._prepare_text_ids(ctx)}
    with torch.no_grad():
        want = model(**feed, return_dict=False)[0].numpy()
    (got,) = open_session(out / "transformer").run(None, {k: v.numpy() for k, v in feed.items()})
    assert got.shape == (batch, side * side, 16)
    assert _rel(got, want) < 1e-4


@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
def test_vae_decoder_equals_diffusers(published, fp32_export) -> None:
    from diffusers import AutoencoderKLFlux2

    _, folder = published
    out, _ = fp32_export
    vae = AutoencoderKLFlux2.from_pretrained(folder / "vae", dtype=torch.float32).eval()
    z = torch.randn(1, 4, 7, 9, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0].numpy()
    (got,) = open_session(out / "vae_decoder").run(None, {"latent_sample": z.numpy()})
    assert got.shape == (1, 3, 14, 18) and _rel(got, want) < 1e-4


@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
def test_validate_on_onnxruntime_passes_and_says_why_there_are_no_blocks(published, fp32_export, tmp_path) -> None:
    port, _ = published
    out, _ = fp32_export
    report = validate(out / "transformer", runtime="onnxruntime", out=tmp_path, **SMALL)
    d = report.to_dict()
    assert d["verdict"] == "pass", d["reasons"]
    assert d["weights_sha256"] == port["weights"] and d["device"] == "onnxruntime:CPUExecutionProvider"
    assert d["dtype"] == "fp32" and d["golden_dtype"] == "fp64"  # an fp32 golden would make fp32's error zero
    assert 0 < d["output"]["device"]["rel_l2"] < 1e-4 and d["output"]["intrinsic"]["rel_l2"] > 0
    for key in ("weights_sha256", "device", "dtype", "reference", "golden_dtype", "inputs", "output", "rule",
                "summary", "blocks", "blame", "tool", "version"):
        assert key in d  # the fields publish and readers rely on
    assert d["blocks"] == [] and d["blame"] is None and len(d["summary"]) == 1 + 3
    assert d["localisation"]["per_block"] is False
    assert "not available through an ONNX graph" in d["localisation"]["note"]
    assert "not available through an ONNX graph" in (tmp_path / "report.md").read_text()
    assert d["environment"]["device"]["provider"] == "CPUExecutionProvider"


def _perturb_external_tensor(folder: Path, name_part: str, scale: float) -> str:
    """Add noise to one initializer by editing the bytes of model.onnx.data in place."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    init = next(t for t in model.graph.initializer if name_part in t.name)
    assert init.data_location == onnx.TensorProto.EXTERNAL
    where = {e.key: e.value for e in init.external_data}
    offset, length = int(where["offset"]), int(where["length"])
    with open(folder / where["location"], "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(length), dtype=np.float32).copy()
        values += scale * values.std() * np.random.default_rng(0).standard_normal(values.shape).astype(np.float32)
        f.seek(offset)
        f.write(values.tobytes())
    return init.name


@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
def test_export_with_one_weight_edited_in_the_external_data_fails(fp32_export, tmp_path) -> None:
    out, _ = fp32_export
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    name = _perturb_external_tensor(broken / "transformer", BROKEN_WEIGHT, 0.1)
    assert BROKEN_WEIGHT in name
    d = validate(broken / "transformer", runtime="onnxruntime", **SMALL).to_dict()
    assert d["verdict"] == "fail"
    assert any("final output error" in r for r in d["reasons"]) and d["output"]["ratio"] > 10
    # the untouched export passes (test_validate_on_onnxruntime_passes...): the fault, not the runner, fails it


@pytest.mark.slow  # a second whole export (fp16): about a minute on two cores
def test_fp16_export_validates_against_fp16s_own_error(fp16_export, tmp_path) -> None:
    out, result = fp16_export
    assert result.opset_requested == 18 and result.opset_produced == 18 and result.notices == []
    d = validate(out / "transformer", runtime="onnxruntime", **SMALL).to_dict()
    assert d["verdict"] == "pass", d["reasons"]
    assert d["dtype"] == "fp16" and d["golden_dtype"] == "fp32"
    # judged against a real fp16 error (torch fp16 on CPU), not against zero
    assert d["output"]["intrinsic"]["rel_l2"] > 1e-4 and d["output"]["ratio"] <= 2.0
    assert 1e-4 < d["output"]["device"]["rel_l2"] < 1e-2


@pytest.mark.parametrize("provider, package", [("CUDAExecutionProvider", "onnxruntime-gpu"),
                                               ("CANNExecutionProvider", "onnxruntime-cann")])
@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
def test_provider_not_installed_is_exit_2_naming_the_package(fp32_export, capsys, provider, package) -> None:
    out, _ = fp32_export
    code, stdout, err = run_cli(["validate", str(out / "transformer"), "--runtime", "onnxruntime", "--provider",
                                 provider, "--json"], capsys)
    assert code == 2
    doc = json.loads(stdout)
    assert package in doc["hint"] and provider in doc["error"] and "Traceback" not in err


@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
def test_generate_runs_the_onnx_transformer_and_draws_the_same_image(published, fp32_export, tmp_path) -> None:
    from PIL import Image

    _, folder = published
    out, _ = fp32_export
    onnx_result = generate(out, "a red fox", steps=2, seed=3, size=32, output=tmp_path / "onnx.png", progress=False)
    generate(folder, "a red fox", steps=2, seed=3, size=32, output=tmp_path / "torch.png", progress=False)
    got = np.asarray(Image.open(tmp_path / "onnx.png"), dtype=np.int16)
    want = np.asarray(Image.open(tmp_path / "torch.png"), dtype=np.int16)
    assert onnx_result.transformer_runtime == "onnxruntime:CPUExecutionProvider"
    assert got.shape == (32, 32, 3) and got.std() > 1 and np.abs(got - want).max() <= 1


@pytest.mark.slow  # a second whole export (fp16): about a minute on two cores
def test_the_fp16_export_generates_an_image(published, fp16_export, tmp_path, capsys) -> None:
    """docs/export.md's first commands: an fp16 export, then `port generate` on it. The fp16 graph runs among the
    source's fp32 torch components: its latents reach the VAE in their dtype (it ended in exit 70, `Input type
    (c10::Half) and bias type (float)`, after every denoising step), and the image is the torch pipeline's within
    fp16's rounding."""
    from PIL import Image

    _, folder = published
    out, _ = fp16_export
    code, _, err = run_cli(["generate", str(out), "--prompt", "a red fox", "--steps", "2", "--seed", "3", "--size",
                            "32", "--output", str(tmp_path / "onnx16.png"), "--quiet"], capsys)
    assert code == 0, err
    generate(folder, "a red fox", steps=2, seed=3, size=32, output=tmp_path / "torch.png", progress=False)
    got = np.asarray(Image.open(tmp_path / "onnx16.png"), dtype=np.int16)
    want = np.asarray(Image.open(tmp_path / "torch.png"), dtype=np.int16)
    assert got.shape == (32, 32, 3) and got.std() > 1
    assert np.abs(got - want).mean() < 1.0 and np.abs(got - want).max() <= 8


def test_bf16_export_is_refused_with_the_reason(published, tmp_path, capsys) -> None:
    _, folder = published
    code, _, err = run_cli(["export", str(folder), "--format", "onnx", "--out", str(tmp_path / "x"), "--dtype",
                            "bf16"], capsys)
    assert code == 2 and "no bf16 kernels" in err and not (tmp_path / "x").exists()


def test_a_model_that_cannot_fit_is_refused_before_exporting(published, tmp_path) -> None:
    _, folder = published
    with pytest.raises(PortError, match=r"needs about .* GiB of memory .* available"):
        export_onnx(folder, tmp_path / "x", components=["transformer"], available_bytes=2**20)
    assert not (tmp_path / "x").exists()
    # klein-9B in fp32 (36 GB of weights) cannot be exported on a 24 GiB machine; the estimate says by how much
    from diffusers import Flux2Transformer2DModel

    cfg = {k: v for k, v in REAL_FLUX2["klein-9b"].items() if not k.startswith("_")}
    params = sum(p.numel() for p in diffusers_skeleton(Flux2Transformer2DModel, cfg).parameters())
    with pytest.raises(PortError, match="9.0. B parameters in float32"):
        check_fits("transformer", params, torch.float32, 24 * 2**30)


@pytest.mark.slow  # needs the whole fp32 ONNX export (about a minute and a half on two cores)
def test_runners_follow_the_protocol(fp32_export, published) -> None:
    from validation.runners.onnxruntime import OrtRunner
    from validation.runners.torch_staged import torch_runner
    from validation.weights import WeightSource

    out, _ = fp32_export
    source = WeightSource(published[1] / "transformer")
    ort_runner = OrtRunner(out / "transformer", "CPUExecutionProvider", torch.float32, source.stages.forward_kwargs)
    staged = torch_runner(source, torch.device("cpu"), torch.float32)
    assert isinstance(ort_runner, Runner) and isinstance(staged, Runner)
    assert ort_runner.stage_names() == ["output"] and not ort_runner.localises and staged.localises


def test_missing_onnx_extra_names_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what an environment without the extra looks like
    with pytest.raises(DeviceError) as err:
        require("onnxruntime")
    assert "flux-port[onnx]" in err.value.hint
