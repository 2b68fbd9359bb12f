"""Running Nunchaku SVDQuant files packed (porting/runtime): the kernel's activation rounding rules, the packed model
against the converted bf16 folder (w4a16) and against 4-bit activation noise (w4a4), and the pipeline verbs
(generate, compare, bench) with an SVDQuant file as the transformer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .helpers import run_port

pytest.importorskip("deepcompressor.backend.nunchaku.convert",
                    reason="the oracle: pip install --no-deps deepcompressor-toolkit==0.1.0 (as .ci/run does)")

from porting.runtime.svdq_act import (  # noqa: E402
    e2m1_round,
    int4_activations,
    int4_codes,
    int4_groups_accumulated,
    nvfp4_activations,
    round_to,
    smoothed,
)
from porting.runtime.svdq_linear import SvdqLinear  # noqa: E402
from porting.runtime.svdq_model import load_svdq_transformer, packed_bytes, set_compute  # noqa: E402

from .svdqfiles import write_svdq_file  # noqa: E402

CASES = [("flux2", "int4"), ("flux2", "nvfp4"), ("flux1", "int4"), ("flux1", "nvfp4")]


def _model(config: dict, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    import diffusers

    model = getattr(diffusers, config["_class_name"]).from_config({k: v for k, v in config.items()
                                                                   if not k.startswith("_")})
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def _inputs(config: dict, family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens, text = 16, 8
    out = {"hidden_states": torch.randn(1, tokens, config["in_channels"], generator=gen),
           "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"], generator=gen),
           "timestep": torch.tensor([0.5])}
    grid = [torch.arange(4.0), torch.arange(4.0)]
    if family == "flux2":
        out["img_ids"] = torch.stack(torch.meshgrid(torch.zeros(1), torch.zeros(1), *grid, indexing="ij"),
                                     -1).reshape(-1, 4)
        out["txt_ids"] = torch.zeros(text, 4)
        out["txt_ids"][:, 3] = torch.arange(text)
    else:
        out["img_ids"] = torch.stack(torch.meshgrid(torch.zeros(1), *grid, indexing="ij"), -1).reshape(-1, 3)
        out["txt_ids"] = torch.zeros(text, 3)
        out["pooled_projections"] = torch.randn(1, config["pooled_projection_dim"], generator=gen)
        out["guidance"] = torch.tensor([3.5])
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- the rounding rules (svdquant.md 10.2, 10.3) ------------------------------------------------------------------

def test_e2m1_is_nearest_even_and_saturates():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.5, 0.2])
    assert e2m1_round(v).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -6.0, 0.0]


def test_int4_codes_ties_to_even_signed_and_unsigned():
    h = torch.zeros(1, 64)
    h[0, :5] = torch.tensor([7.0, 3.5, 2.5, -7.0, -0.5])  # amax 7: σ = 1
    q, sigma = int4_codes(h)
    assert sigma.item() == 1.0 and q[0, 0, :5].tolist() == [7.0, 4.0, 2.0, -7.0, -0.0]
    u = torch.zeros(1, 64)
    u[0, :3] = torch.tensor([15.0, 6.5, -3.0])  # unsigned: σ = amax / 15, negatives clamp to 0
    q, sigma = int4_codes(u, unsigned=True)
    assert sigma.item() == 1.0 and q[0, 0, :3].tolist() == [15.0, 6.0, 0.0]
    assert torch.equal(int4_activations(torch.zeros(2, 128), torch.bfloat16), torch.zeros(2, 128))  # no NaN


def test_int4_codes_use_the_unrounded_scale_and_dequantize_with_the_rounded_one():
    h = torch.zeros(1, 64)
    h[0, 0] = 1.0 + 2**-8  # σ = h0 / 7 is not a bf16 number
    a = int4_activations(h, torch.bfloat16)
    sigma = h[0, 0] / 7
    assert a[0, 0].item() == 7 * sigma.to(torch.bfloat16).float().item()


def test_nvfp4_scales_are_e4m3_and_tiny_groups_vanish():
    h = torch.zeros(2, 16)
    h[0, :4] = torch.tensor([6.0, 0.25, 5.0, 3.5])  # σ = 1
    h[1, 0] = 6 * 0.3 * 2**-9  # σ below half of e4m3's smallest subnormal: a8 = 0, the group is 0
    a = nvfp4_activations(h)
    assert a[0, :4].tolist() == [6.0, 0.0, 4.0, 4.0]
    assert torch.equal(a[1], torch.zeros(16))


def test_smoothing_rounds_to_the_activation_dtype_after_the_shift():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    s = torch.tensor([3.0, 3.0], dtype=torch.bfloat16)
    h = smoothed(x, s, 0.171875)
    want = (round_to(x.float() + 0.171875, torch.bfloat16) / 3).to(torch.bfloat16).float()
    assert torch.equal(h, want)


# -- the packed model ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_packed_model_equals_the_converted_folder_and_w4a4_is_activation_noise(case, tmp_path, capsys):
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    family, precision = case
    fx = write_svdq_file(tmp_path / "src", family, precision)
    out = tmp_path / "bf16"
    assert run_port(capsys, "convert", fx.path, "--out", out).code == 0
    cls = Flux2Transformer2DModel if family == "flux2" else FluxTransformer2DModel
    converted = cls.from_pretrained(out, torch_dtype=torch.float32).eval()
    oracle = _model(fx.config, fx.expected)
    packed = load_svdq_transformer(fx.path, torch.float32, "w4a16")
    linears = [m for m in packed.modules() if isinstance(m, SvdqLinear)]
    assert linears and not any(isinstance(m, torch.nn.Linear) and "ff" in n and "norm" not in n
                               for n, m in packed.named_modules())
    inputs = _inputs(fx.config, family)
    with torch.no_grad():
        w4a16 = packed(**inputs, return_dict=False)[0]
        want = oracle(**inputs, return_dict=False)[0]
        bf16 = converted(**inputs, return_dict=False)[0]
        set_compute(packed, "w4a4")
        w4a4 = packed(**inputs, return_dict=False)[0]
    assert _rel(w4a16, want) < 1e-5  # the same weights, computed per band from the packed parts
    assert _rel(w4a16, bf16) < 5e-3  # the converted folder rounds each weight once to bf16
    assert 1e-3 < _rel(w4a4, w4a16) < 0.3, _rel(w4a4, w4a16)  # 4-bit activations: noise, not another network
    quantized = sum(m.in_features * m.out_features * 2 for m in linears)  # their bf16 bytes
    assert packed_bytes(packed) < quantized


def test_fast_accumulation_is_within_a_few_percent_of_the_kernels_group_order(tmp_path):
    """One int4 layer in bf16: the fp32 accumulation (what SvdqLinear does) against the kernel's per-group bf16
    accumulation (svdquant.md 10.4); the measured gap goes into docs/quantized.md."""
    fx = write_svdq_file(tmp_path / "src", "flux2", "int4")
    model = load_svdq_transformer(fx.path, torch.bfloat16, "w4a4")
    piece = model.transformer_blocks[0].ff.linear_in.pieces[0]
    x = torch.randn(64, piece.k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    h = smoothed(x, piece.smooth)
    q, sigma = int4_codes(h)
    codes = q.reshape(x.shape)
    signed = piece.values(0, piece.n) / piece.scales.float().repeat_interleave(64, dim=1)
    act_scales = round_to(sigma, torch.bfloat16).reshape(x.shape[0], -1)
    grouped = int4_groups_accumulated(codes, act_scales, signed, piece.scales.float(), torch.bfloat16)
    fast = round_to((codes.reshape_as(q) * act_scales[..., None]).reshape(x.shape) @ piece.values(0, piece.n).t(),
                    torch.bfloat16)
    gap = _rel(fast, grouped)
    assert 0 < gap < 0.03, gap


# -- the verbs --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def klein(tmp_path_factory) -> tuple[Path, Path]:
    from porting.demo.bases import write_tiny_base

    root = tmp_path_factory.mktemp("svdq-verbs")
    base = write_tiny_base(root / "base", "klein")
    return base, write_svdq_file(root / "src", "flux2", "int4").path


def test_generate_with_an_svdquant_transformer(klein, tmp_path, capsys):
    base, svdq = klein
    image = tmp_path / "out.png"
    run = run_port(capsys, "generate", base, "--transformer", svdq, "--prompt", "a fox", "--steps", "2",
                   "--size", "32", "--output", image, "--json", "--quiet")
    assert run.code == 0, run.err
    assert image.is_file() and json.loads(run.out)["peak_memory_bytes"] > 0


@pytest.mark.slow  # FLUX.1's GELU-shift path is also held by the packed-model test in the README command
def test_generate_flux1_gelu_shift_path(tmp_path, capsys):
    from porting.demo.bases import write_tiny_base

    base = write_tiny_base(tmp_path / "base", "flux1-dev")
    svdq = write_svdq_file(tmp_path / "src", "flux1", "int4").path
    for compute in ("w4a4", "w4a16"):
        run = run_port(capsys, "generate", base, "--transformer", svdq, "--svdq-compute", compute, "--prompt", "a fox",
                       "--steps", "1", "--size", "32", "--output", tmp_path / f"{compute}.png", "--quiet")
        assert run.code == 0, run.err


def test_compare_base_against_the_svdquant_candidate(klein, tmp_path, capsys):
    base, svdq = klein
    run = run_port(capsys, "compare", base, base, "--candidate-transformer", svdq, "--prompt", "a fox", "--steps", "2",
                   "--size", "32", "--out", tmp_path / "cmp", "--json", "--quiet")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["candidate"]["svdq_compute"] == "w4a4" and "svdq_compute" not in doc["reference"]
    assert doc["summary"]["psnr"]["mean"] > 0 and doc["images"][0]["psnr"] < 99  # not the same images


def test_bench_with_an_svdquant_transformer_reports_the_packed_size(klein, tmp_path, capsys):
    base, svdq = klein
    run = run_port(capsys, "bench", base, "--transformer", svdq, "--svdq-compute", "w4a16", "--offload", "none",
                   "--task", "t2i", "--steps", "1", "--runs", "1", "--warmup", "0", "--size", "32",
                   "--out", tmp_path / "bench", "--json", "--quiet")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["svdq"]["compute"] == "w4a16" and doc["svdq"]["packed_bytes"] == svdq.stat().st_size - (
        8 + int.from_bytes(svdq.read_bytes()[:8], "little"))
    assert doc["rows"][0]["status"] == "ok"


def test_bad_svdq_compute_is_refused(klein, tmp_path, capsys):
    base, svdq = klein
    run = run_port(capsys, "generate", base, "--transformer", svdq, "--svdq-compute", "w8a8", "--prompt", "x",
                   "--output", tmp_path / "x.png")
    assert run.code == 2 and "w8a8" in run.err


SLOW = pytest.mark.slow  # the same path as the case kept in the README command, on the other families / precisions


@pytest.mark.parametrize("family,precision", [("flux2", "int4"), pytest.param("flux1", "int4", marks=SLOW),
                                              pytest.param("flux1", "nvfp4", marks=SLOW),
                                              pytest.param("flux2", "nvfp4", marks=SLOW)])
def test_validate_runs_the_packed_computation_on_reference_and_device(family, precision, tmp_path, capsys):
    """--svdq-compute w4a4: golden, intrinsic and device runs all compute packed (the golden in float32), so the
    verdict is the device's packed run against the same computation (ratio near 1, pass); each block's 4-bit column
    (packed golden vs the float32 run of the dequantized weights) shows the activation noise the plain run lacks."""
    svdq = write_svdq_file(tmp_path / "src", family, precision).path
    errors = {}
    for compute in (None, "w4a4"):
        extra = ["--svdq-compute", compute] if compute else []
        run = run_port(capsys, "validate", svdq, "--resolution", "64", "--text-len", "16", "--timesteps", "0.5",
                       "--out", tmp_path / f"v-{compute}", "--json", "--quiet", *extra)
        assert run.code == 0, run.err
        doc = json.loads(run.out)
        assert doc["verdict"] == "pass"
        block = next(b for b in doc["blocks"] if b["stage"] == "transformer_blocks.0")
        assert block["teacher_forced"]["ratio"] < 1.5
        errors[compute] = block["teacher_forced"]["device"]["rel_l2"]
        if compute:
            errors["4-bit"] = block["quantization"]["rel_l2"]
            assert "4-bit vs dequantized" in (tmp_path / f"v-{compute}" / "report.md").read_text()
        else:
            assert "quantization" not in block
    assert errors["4-bit"] > 1e-3 and errors["4-bit"] > errors[None] / 10, errors


def test_a_released_packed_stage_holds_no_memory(tmp_path):
    """The packed linears' weights are buffers, which porting.skeleton.release keeps: the staged runner drops them
    itself, or every stage validated would stay packed in memory."""
    from validation.packed import PackedLinears
    from validation.staged import StagedModel
    from validation.weights import WeightSource

    source = WeightSource(write_svdq_file(tmp_path / "src", "flux2", "int4").path)
    staged = StagedModel(source, torch.device("cpu"), torch.float32, packed=PackedLinears(source))
    stage = "transformer_blocks.0"
    module = staged.model.get_submodule(stage)
    staged.materialise(stage)
    packed = [m for m in module.modules() if isinstance(m, SvdqLinear)]
    assert packed and all(not b.is_meta for m in packed for b in m.buffers())
    staged.release(stage)
    held = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_meta]
    assert held == []


@pytest.mark.slow  # the klein int4 compare and bench above run in the README command
@pytest.mark.parametrize("family,precision,variant", [("flux2", "nvfp4", "klein"), ("flux1", "int4", "flux1-dev"),
                                                      ("flux1", "nvfp4", "flux1-dev")])
def test_compare_and_bench_on_both_families_and_precisions(family, precision, variant, tmp_path, capsys):
    """S2's two tables on the tiny models: compare the base against its SVDQuant transformer, bench it packed."""
    from porting.demo.bases import write_tiny_base

    base = write_tiny_base(tmp_path / "base", variant)
    svdq = write_svdq_file(tmp_path / "src", family, precision).path
    run = run_port(capsys, "compare", base, base, "--candidate-transformer", svdq, "--prompt", "a fox", "--steps", "1",
                   "--size", "32", "--out", tmp_path / "cmp", "--json", "--quiet")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["candidate"]["svdq_compute"] == "w4a4" and doc["summary"]["psnr"]["mean"] > 0
    run = run_port(capsys, "bench", base, "--transformer", svdq, "--offload", "none", "--task", "t2i", "--steps", "1",
                   "--runs", "1", "--warmup", "0", "--size", "32", "--out", tmp_path / "bench", "--json", "--quiet")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["svdq"]["compute"] == "w4a4" and doc["rows"][0]["status"] == "ok"


def test_svdq_compute_with_devices_is_refused_before_any_rank_starts(tmp_path, capsys):
    svdq = write_svdq_file(tmp_path / "src", "flux2", "int4").path
    run = run_port(capsys, "validate", svdq, "--svdq-compute", "w4a4", "--devices", "cpu,cpu", "--json")
    assert run.code == 2 and "--svdq-compute" in json.loads(run.out)["error"]
    assert "pipeline stages" not in run.err  # refused before the ranks were announced or spawned
