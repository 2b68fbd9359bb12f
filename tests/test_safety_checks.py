"""Issue 17, items 7-9, through the real CLI on tiny real models: a validation that cannot fail does not pass,
options are what they say, and a run that cannot fit in memory (or an image bomb) is refused before any work.

Every refusal: exit 2, the option / tensor / stage named, no traceback, nothing written.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import pytest
import torch

from .helpers import run_port, save_state
from .test_safety import assert_clean_refusal, snapshot

FAST = ["--resolution", "32", "--text-len", "8", "--timesteps", "1.0", "--quiet"]


def _validate(capsys, model: Path, out: Path, *args: str):
    return run_port(capsys, "validate", model, "--out", out, *FAST, *args)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny2_state) -> dict[str, Path]:
    """The tiny FLUX.2 weights, and the same weights with one fault injected each."""
    root = tmp_path_factory.mktemp("faults")
    zero = {k: torch.zeros_like(v) for k, v in tiny2_state.items()}
    nan = {k: v.clone() for k, v in tiny2_state.items()}
    nan["double_blocks.0.img_attn.qkv.weight"][3, 2] = float("nan")
    huge = {k: v.clone() for k, v in tiny2_state.items()}
    huge["double_blocks.1.img_mlp.0.weight"] *= 1e37  # finite weights whose activations overflow float32
    return {"good": save_state(root / "good.safetensors", tiny2_state, torch.bfloat16),
            "zero": save_state(root / "zero.safetensors", zero),
            "nan": save_state(root / "nan.safetensors", nan),
            "huge": save_state(root / "huge.safetensors", huge)}


# --- 7. a validation that cannot fail does not pass ----------------------------------------------------------------

def test_fp32_against_a_fp32_golden_is_refused_before_any_work(capsys, tmp_path: Path, models) -> None:
    out = tmp_path / "reports"
    run = _validate(capsys, models["good"], out, "--dtype", "fp32")
    assert_clean_refusal(run, 2, "--dtype fp32 against a fp32 golden on cpu", "one computation", "--golden-dtype fp64")
    assert not out.exists()


def test_fp32_against_a_fp64_golden_is_measured(capsys, tmp_path: Path, models) -> None:
    run = _validate(capsys, models["good"], tmp_path / "r", "--dtype", "fp32", "--golden-dtype", "fp64", "--json")
    assert run.code == 0, run.err
    assert (tmp_path / "r" / "report.json").is_file()


def test_an_all_zero_model_is_unmeasurable_not_pass(capsys, tmp_path: Path, models) -> None:
    out = tmp_path / "reports"
    run = _validate(capsys, models["zero"], out)
    assert_clean_refusal(run, 2, "the golden's output (stage final) is all zeros", "an all-zero model")
    assert "PASS" not in run.err and not out.exists()


def test_a_non_finite_golden_weight_is_refused_by_name(capsys, tmp_path: Path, models) -> None:
    out = tmp_path / "reports"
    run = _validate(capsys, models["nan"], out)
    # double_blocks.0.img_attn.qkv is split into to_q / to_k / to_v; row 3 is in to_q
    assert_clean_refusal(run, 2, "weight transformer_blocks.0.attn.to_q.weight holds 1 NaN/Inf value(s)")
    assert not out.exists()


def test_a_golden_that_overflows_is_refused_naming_the_stage(capsys, tmp_path: Path, models) -> None:
    out = tmp_path / "reports"
    run = _validate(capsys, models["huge"], out)
    assert_clean_refusal(run, 2, "the golden (float32 on cpu) computes NaN/Inf in transformer_blocks.1")
    assert not out.exists()


def test_errors_both_exactly_zero_are_unmeasurable(capsys, monkeypatch, tmp_path: Path, models) -> None:
    # the up-front refusal switched off: the runs happen, and the judge still refuses a 0 / 0 comparison
    import validation.api

    monkeypatch.setattr(validation.api, "check_not_one_computation", lambda **kw: None)
    out = tmp_path / "reports"
    run = _validate(capsys, models["good"], out, "--dtype", "fp32")
    assert_clean_refusal(run, 2, "errors against the fp32 golden are both exactly 0")
    assert not out.exists()


def test_a_non_finite_intrinsic_run_is_no_denominator() -> None:
    from validation.checks import Unmeasurable, check_measurable

    finite = {"rel_l2": 0.01, "nonfinite": 0}
    with pytest.raises(Unmeasurable, match="intrinsic fp16 run computes NaN/Inf"):
        check_measurable(torch.ones(3), finite, {"rel_l2": math.inf, "nonfinite": 2}, dtype="fp16",
                         golden_dtype="fp32", weights=None)
    check_measurable(torch.ones(3), finite, {"rel_l2": 0.01, "nonfinite": 0}, dtype="fp16", golden_dtype="fp32",
                     weights=None)  # a real measurement goes on to the verdict


@pytest.mark.parametrize("fault, code, phrases", [
    ("zero", 2, ("all-zero layer(s) transformer_blocks.0.attn.to_out.0.weight", "dequantized from",
                 "golden runs on these same dequantized weights")),
    # a non-finite value is refused where it is dequantized (item 6's check, exit 1), before any stage runs
    ("nan", 1, ("tensor 'double_blocks.0.img_attn.proj.weight' once dequantized holds 4096 NaN or infinite",)),
])
def test_a_quantized_source_with_a_damaged_layer_is_flagged_before_validation(capsys, tmp_path: Path, tiny2_state,
                                                                              fault: str, code: int,
                                                                              phrases: tuple[str, ...]) -> None:
    from . import quantfiles as qf

    tensors, _ = qf.bfl_fp8(tiny2_state)
    key = "double_blocks.0.img_attn.proj.weight"  # = transformer_blocks.0.attn.to_out.0.weight
    value = 0.0 if fault == "zero" else float("nan")
    tensors[key] = torch.full(tensors[key].shape, value).to(tensors[key].dtype)
    path = qf.save(tmp_path / "ft" / "klein-fp8.safetensors", tensors)
    before = snapshot(tmp_path)
    run = _validate(capsys, path, tmp_path / "reports")
    assert_clean_refusal(run, code, *phrases)
    assert snapshot(tmp_path) == before


# --- 8. options are what they say ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def published(port: dict, tmp_path_factory) -> Path:
    from porting.pipeline.publish import publish

    out = tmp_path_factory.mktemp("pub") / "klein"
    publish(port["base"], port["transformer"], out, report=port["pass"])
    return out


@pytest.mark.parametrize("verb, args, phrase", [
    ("generate", ["--prompt", "x", "--steps", "0"], "--steps 0: needs at least 1"),
    ("compare", ["{folder}", "--steps", "0"], "--steps 0: needs at least 1"),
    ("bench", ["--steps", "0"], "--steps 0: needs at least 1"),
    ("generate", ["--prompt", "x", "--steps", "-2"], "--steps -2: needs at least 1"),
    ("export", ["--out", "{tmp}/x", "--opset", "0"], "--opset 0"),
    ("export", ["--out", "{tmp}/x", "--opset", "17"], "--opset 17"),
    ("export", ["--out", "{tmp}/x", "--opset", "999"], "--opset 999"),
    ("compare", ["{folder}", "--min-psnr", "nan"], "--min-psnr nan"),
    ("compare", ["{folder}", "--max-lpips", "inf"], "--max-lpips inf"),
    ("compare", ["{folder}", "--diff-gain", "nan"], "--diff-gain nan"),
    ("compare", ["{folder}", "--guidance-scale", "nan"], "--guidance-scale nan"),
    ("generate", ["--prompt", "x", "--guidance-scale", "-inf"], "--guidance-scale -inf"),
    ("bench", ["--guidance-scale", "nan"], "--guidance-scale nan"),
    ("validate", ["--max-ratio", "inf"], "--max-ratio inf"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_meaningless_option_is_refused_by_name(capsys, tmp_path: Path, published: Path, verb: str,
                                                args: list[str], phrase: str) -> None:
    args = [a.replace("{folder}", str(published)).replace("{tmp}", str(tmp_path)) for a in args]
    before = snapshot(tmp_path)
    run = run_port(capsys, verb, published, *args)
    assert_clean_refusal(run, 2, phrase)
    assert snapshot(tmp_path) == before and not (published / "reports").exists()


@pytest.mark.parametrize("value, phrase", [("nan", "--timeout nan"), ("inf", "--timeout inf")])
def test_a_non_finite_fetch_timeout_is_refused(capsys, tmp_path: Path, value: str, phrase: str) -> None:
    run = run_port(capsys, "fetch", "hf:org/name", "--out", tmp_path / "x", "--timeout", value, "--dry-run")
    assert_clean_refusal(run, 2, phrase)
    assert not (tmp_path / "x").exists()


def test_a_non_finite_merge_strength_is_refused(capsys, tmp_path: Path, tiny2_state) -> None:
    from .lorakit import BY_NAME, adapter_for

    base = save_state(tmp_path / "base.safetensors", tiny2_state)
    adapter, _ = adapter_for(tmp_path / "style.safetensors", BY_NAME["kohya"], tiny2_state, seed=1)
    run = run_port(capsys, "merge", base, f"{adapter}:nan", "--out", tmp_path / "merged")
    assert_clean_refusal(run, 2, "strength nan", "not a finite number")
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("argv", [
    ["convert", "{src}", "--out", ""],
    ["merge", "{src}", "{src}", "--out", ""],
    ["validate", "{src}", "--out", ""],
    ["export", "{folder}", "--out", ""],
    ["publish", "--base", "{folder}", "--transformer", "{folder}/transformer", "--out", ""],
    ["compare", "{folder}", "{folder}", "--out", ""],
    ["bench", "{folder}", "--out", ""],
    ["fetch", "hf:org/name", "--out", ""],
    ["generate", "{folder}", "--prompt", "x", "--output", ""],
    ["demo", "--workdir", ""],
], ids=lambda argv: argv[0])
def test_an_empty_output_path_is_refused_not_the_current_folder(capsys, monkeypatch, tmp_path: Path, tiny2_file: Path,
                                                                published: Path, argv: list[str]) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "notes.txt").write_text("mine")
    monkeypatch.chdir(cwd)
    argv = [a.replace("{src}", str(tiny2_file)).replace("{folder}", str(published)) for a in argv]
    run = run_port(capsys, *argv)
    flag = argv[-2]
    assert_clean_refusal(run, 2, f"'{flag}'", "the path is empty")
    assert snapshot(cwd) == {"notes.txt": snapshot(cwd)["notes.txt"]} and (cwd / "notes.txt").read_text() == "mine"


def test_quantize_on_an_adapter_is_refused(capsys, tmp_path: Path, tiny2_state) -> None:
    from .lorakit import BY_NAME, adapter_for

    adapter, _ = adapter_for(tmp_path / "style.safetensors", BY_NAME["kohya"], tiny2_state, seed=1)
    run = run_port(capsys, "convert", adapter, "--to", "original", "--quantize", "fp8-scaled", "--out", tmp_path / "q")
    assert_clean_refusal(run, 2, "--quantize fp8-scaled", "is an adapter")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("args, flag", [(["--lora-style", "kohya"], "--lora-style kohya"),
                                        (["--materialise"], "--materialise")])
def test_adapter_flags_on_full_weights_are_refused(capsys, tmp_path: Path, tiny2_file: Path, args: list[str],
                                                   flag: str) -> None:
    run = run_port(capsys, "convert", tiny2_file, "--to", "original", "--out", tmp_path / "out", *args)
    assert_clean_refusal(run, 2, flag, "applies to adapters only")
    assert not (tmp_path / "out").exists()


# --- 9. bounded resources ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, phrase", [
    (["--resolution", "131072"], "--resolution 131072"),  # 67 M image tokens per case: terabytes of activations
    (["--text-len", "400000000"], "--text-len 400000000"),
])
def test_validate_that_cannot_fit_is_refused_before_any_work(capsys, tmp_path: Path, models, args, phrase) -> None:
    out = tmp_path / "reports"
    run = run_port(capsys, "validate", models["good"], "--out", out, "--timesteps", "1.0", *args)
    assert_clean_refusal(run, 2, phrase, "needs about", "GiB of memory", "is available of")
    assert not out.exists()


def test_export_that_cannot_fit_is_refused_with_the_estimate(capsys, monkeypatch, tmp_path: Path,
                                                             published: Path) -> None:
    import porting.resources

    monkeypatch.setattr(porting.resources, "memory_limit",  # a 2 MiB machine
                        lambda root=None: porting.resources.Limit("the host", 2**20, 2**21))
    run = run_port(capsys, "export", published, "--out", tmp_path / "x", "--components", "transformer")
    assert_clean_refusal(run, 2, "transformer: a streamed export", "needs about", "0.00 GiB is available of 0.00 GiB")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("verb, args", [
    ("compare", ["{folder}", "--size", "65536", "--steps", "1", "--out", "{tmp}/cmp"]),
    ("generate", ["--prompt", "x", "--size", "65536", "--steps", "1", "--output", "{tmp}/x.png"]),
])
def test_a_size_that_cannot_fit_is_refused_before_loading(capsys, tmp_path: Path, published: Path, verb: str,
                                                          args: list[str]) -> None:
    args = [a.replace("{folder}", str(published)).replace("{tmp}", str(tmp_path)) for a in args]
    before = snapshot(tmp_path)
    run = run_port(capsys, verb, published, *args)
    assert_clean_refusal(run, 2, "at 65536x65536 in fp32 needs about", "VAE decode")
    assert snapshot(tmp_path) == before


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height pixels (a few hundred bytes on disk: a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("side, phrase", [
    (9000, "9000x9000 px (81 MP) is larger than the 67 MP"),  # below PIL's own limit: flux-port's check
    (60000, "larger than the 67,108,864 pixels flux-port decodes"),  # PIL's DecompressionBombError
])
@pytest.mark.parametrize("verb", ["generate", "compare"])
def test_an_image_larger_than_the_maximum_is_refused_by_name(capsys, tmp_path: Path, published: Path, verb: str,
                                                             side: int, phrase: str) -> None:
    bomb = _png_header(tmp_path / "bomb.png", side, side)
    extra = ["--prompt", "x", "--output", tmp_path / "x.png"] if verb == "generate" else [published, "--out",
                                                                                          tmp_path / "cmp"]
    before = snapshot(tmp_path)
    run = run_port(capsys, verb, published, *extra, "--image", bomb, "--size", "32", "--steps", "1")
    assert_clean_refusal(run, 2, f"--image {bomb}", phrase)
    assert "DecompressionBombWarning" not in run.err
    assert snapshot(tmp_path) == before


def test_the_validate_estimate_lets_a_real_size_run_through() -> None:
    """klein-9B at 1024 with three timesteps: the streamed fp32 golden fits a 24 GiB host (docs/validate.md)."""
    from porting.resources import check_validate_memory

    cfg = {"num_attention_heads": 32, "attention_head_dim": 128}  # hidden 4096
    block = [(f"transformer_blocks.0.w{i}", (4096, 4096)) for i in range(26)]  # a double block: ~436 M parameters
    need = check_validate_memory(cfg, block + [("context_embedder.weight", (4096, 12288))], resolution=1024,
                                 text_len=512, batch=3, golden_dtype="fp32", dtype="bf16", available=24 * 2**30)
    assert 8 * 2**30 < need < 24 * 2**30
