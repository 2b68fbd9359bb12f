"""Which options apply to which input: one table per surface (porting/cli/_options.py `APPLIES` for convert, merge
and inspect; validation/options.py `APPLIES` for validate), each option in it one the verb has, and the refusals
they give, on the command line and in a jobs file before anything runs."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from porting.cli._options import APPLIES, _option_names, check_applicable, convert_given, convert_kind
from porting.errors import PortError, UsageError
from validation.options import APPLIES as VALIDATE_APPLIES
from validation.options import check_applicable as check_validate

from .helpers import leftovers, run_port

VERBS = {"convert": "porting.cli.convert_cmd", "merge": "porting.cli.merge_cmd", "inspect": "porting.cli.inspect_cmd",
         "validate": "porting.cli.validate_cmd"}


def _flags(verb: str) -> set[str]:
    return set(_option_names(getattr(importlib.import_module(VERBS[verb]), verb)).values())


@pytest.mark.parametrize("verb", ["convert", "merge", "inspect"])
def test_every_option_in_the_table_is_one_the_verb_has(verb: str) -> None:
    flags = _flags(verb)
    for option, applies in APPLIES[verb].items():
        assert option.split()[0] in flags, option
        for needed, _ in applies.needs.values():
            assert needed.split()[0] in flags, needed


def test_every_option_in_validates_table_is_one_validate_has() -> None:
    flags = _flags("validate")
    assert {o for o in VALIDATE_APPLIES if o != "hooks"} <= flags  # hooks: validate()'s own arguments


@pytest.mark.parametrize("quantize, kind", [(None, "weights"), ("svdq-int4", "svdq"), ("svdq-nvfp4", "svdq"),
                                            ("gguf-q8_0", "quantized"), ("fp8-scaled", "quantized")])
def test_convert_kind_follows_quantize(quantize: str | None, kind: str) -> None:
    assert convert_kind("weights", quantize) == kind
    assert convert_kind("adapter", quantize) == "adapter"  # --quantize is then the refusal


@pytest.mark.parametrize("kind, given, error, phrases", [
    ("weights", {"rank": 16}, UsageError, ["--rank applies to --quantize svdq-int4 / svdq-nvfp4 only."]),
    ("adapter", {"rank": 16}, UsageError, ["--rank applies to --quantize svdq"]),
    ("svdq", {"device": "cuda"}, UsageError, ["without --calibrate nothing runs"]),
    ("svdq", {"to": "original"}, UsageError, ["--quantize svdq-int4 writes Nunchaku's own layer names; --to does "
                                              "not apply."]),
    ("svdq", {"dtype": "fp16"}, UsageError, ["--dtype does not apply"]),
    ("quantized", {}, UsageError, ["--quantize gguf-q8_0", "needs --to original"]),
    ("adapter", {"dtype": "fp16"}, PortError, ["--dtype applies to weights"]),
    ("adapter", {"quantize": "fp8-scaled"}, UsageError, ["--quantize fp8-scaled: m.safetensors is an adapter"]),
    # the true reason first: --rank does apply to --quantize svdq-int4, which does not apply to an adapter
    ("adapter", {"quantize": "svdq-int4", "rank": 7}, UsageError, ["--quantize svdq-int4: m.safetensors is an "
                                                                   "adapter"]),
    ("weights", {"verbose": True}, UsageError, ["--verbose applies to --quantize svdq"]),
    ("weights", {"lora_style": "kohya"}, UsageError, ["--lora-style kohya: m.safetensors is transformer weights",
                                                      "applies to adapters only"]),
    ("weights", {"layout": "diffusers"}, UsageError, ["--layout diffusers: m.safetensors is not an SVDQuant model"]),
    ("adapter", {"layout": "nunchaku"}, UsageError, ["--layout nunchaku: m.safetensors is not an SVDQuant model"]),
    ("relayout", {"layout": "diffusers", "to": "original"}, UsageError, ["--to original: --layout moves the packed"]),
    ("relayout", {"layout": "diffusers", "dtype": "fp16"}, UsageError, ["--dtype: --layout moves the packed"]),
    ("relayout", {"layout": "diffusers", "rank": 16}, UsageError, ["--rank applies to --quantize svdq"]),
])
def test_convert_refusals(kind: str, given: dict, error: type, phrases: list[str]) -> None:
    quantize = given.get("quantize") or {"svdq": "svdq-int4", "quantized": "gguf-q8_0"}.get(kind)
    with pytest.raises(error) as e:
        check_applicable("convert", kind, convert_given(**{**given, "quantize": quantize}), src="m.safetensors",
                         quantize=quantize, out="--out DIR")
    for phrase in phrases:
        assert phrase in e.value.message, e.value.message


@pytest.mark.parametrize("kind, given", [("weights", {"to": "original", "dtype": "fp16"}),
                                         ("svdq", {"rank": 16, "calibrate": "base", "device": "cuda",
                                                   "layout": "diffusers"}),
                                         ("relayout", {"layout": "nunchaku"}),
                                         ("quantized", {"to": "original", "dtype": "bf16"}),
                                         ("adapter", {"lora_style": "bfl", "materialise": True, "to": "original"})])
def test_convert_options_where_they_apply_pass(kind: str, given: dict) -> None:
    quantize = {"svdq": "svdq-int4", "quantized": "gguf-q8_0"}.get(kind)
    check_applicable("convert", kind, convert_given(**given, quantize=quantize), src="m", quantize=quantize, out="")


def test_validate_refusals() -> None:
    fields = {"device": "cuda", "devices": "cuda:0,cuda:1", "ort_threads": 2}
    with pytest.raises(UsageError, match="--devices cuda:0,cuda:1 with --device cuda: give the devices once"):
        check_validate("torch", {"--device": "cuda", "--devices": "cuda:0,cuda:1"}, **fields)
    with pytest.raises(PortError, match="--ort-threads 2: only with --runtime onnxruntime"):
        check_validate("torch", {"--ort-threads": 2}, **fields)
    with pytest.raises(UsageError, match="--svdq-compute runs the packed linears"):
        check_validate("onnxruntime", {"--svdq-compute": "w4a4"}, **fields)
    with pytest.raises(PortError, match="--devices with --runtime onnxruntime"):
        check_validate("onnxruntime", {"--devices": "cuda:0,cuda:1"}, **fields)
    with pytest.raises(PortError, match="the onnxruntime runner has none"):
        check_validate("onnxruntime", {"hooks": True}, **fields)
    with pytest.raises(PortError, match="--prompt needs --base"):
        check_validate("torch", {"--prompt": "a fox", "--base": None}, **fields)
    check_validate("onnxruntime", {"--ort-threads": 2, "--prompt": "a fox", "--base": Path("b")}, **fields)
    check_validate("torch", {"--devices": "cuda:0,cuda:1", "--svdq-compute": None}, **fields)


def test_an_option_for_svdq_on_an_adapter_is_refused(capsys, tmp_path: Path, tiny2_state) -> None:
    """--rank on an adapter was passed over without a word; the table refuses it as it does on weights."""
    from .lorakit import BY_NAME, adapter_for

    adapter, _ = adapter_for(tmp_path / "style.safetensors", BY_NAME["kohya"], tiny2_state, seed=1)
    run = run_port(capsys, "convert", adapter, "--rank", "16", "--out", tmp_path / "a")
    assert run.code == 2 and "--rank applies to --quantize svdq" in run.msg, run.msg
    assert leftovers(tmp_path / "a") == []


def test_merge_refuses_requantize_on_a_plain_base_before_reading_adapters(capsys, tmp_path: Path,
                                                                           tiny2_file: Path) -> None:
    run = run_port(capsys, "merge", tiny2_file, tmp_path / "not-there.safetensors", "--out", tmp_path / "m",
                   "--max-error", "0.1")
    assert run.code == 2 and "--max-error applies to Nunchaku SVDQuant bases" in run.msg, run.msg
    assert leftovers(tmp_path / "m") == []


def test_a_jobs_file_convert_option_where_it_does_not_apply_is_refused_before_anything(capsys, tmp_path: Path,
                                                                                        tiny2_file: Path) -> None:
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[job]]\nname = "a"\nsource = "{tiny2_file}"\nsteps = ["convert"]\n'
                    'convert = { quantize = "gguf-q8_0" }\n')
    run = run_port(capsys, "batch", jobs, "--out", tmp_path / "out", "--json")
    assert run.code == 2, (run.out, run.err)
    error = json.loads(run.out)["error"]
    assert "[[job]] #1 (a): convert: --quantize gguf-q8_0" in error and "needs --to original" in error, error
    assert not (tmp_path / "out").exists()
