"""Issue 29 (hostile inputs, round three), rules 4 and 5, as a hostile (or broken) exporter would write the inputs:
numbers are typed (refused by key, nothing written, or handled as documented: `--skip '*.alpha'` drops alphas, not
modules), and refusals give the true reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .helpers import leftovers, run_port
from .lorakit import BY_NAME, adapter_for

MODULE = "double_blocks.0.img_attn.qkv"


@pytest.fixture(scope="module")
def base(tiny2_file: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny2_file))


def _rewritten(src: Path, dst: Path, change) -> Path:
    tensors = load_file(str(src))
    change(tensors)
    save_file(tensors, str(dst))
    return dst


def _merge(capsys, tiny2_file: Path, adapter: Path, out: Path, *extra: str):
    return run_port(capsys, "merge", tiny2_file, adapter, "--out", out, "--json", *extra)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("verb", ["merge", "convert"])
def test_integer_or_boolean_factors_are_refused_by_key(base, tiny2_file, tmp_path, capsys, dtype, verb):
    adapter, _ = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1)
    key = next(k for k in load_file(str(adapter)) if k.endswith("lora_up.weight"))
    bad = _rewritten(adapter, tmp_path / "bad.safetensors",
                     lambda t: t.__setitem__(key, (t[key] * 100).to(dtype) if dtype != torch.bool else t[key] > 0))
    out = tmp_path / "out"
    run = (_merge(capsys, tiny2_file, bad, out) if verb == "merge" else
           run_port(capsys, "convert", bad, "--out", out, "--json"))
    assert run.code == 2, run.err
    error = json.loads(run.out)["error"]
    assert key in error and "floating-point" in error
    assert leftovers(out) == []


def test_a_boolean_alpha_is_refused(base, tiny2_file, tmp_path, capsys):
    adapter, _ = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1)
    key = next(k for k in load_file(str(adapter)) if k.endswith(".alpha"))
    bad = _rewritten(adapter, tmp_path / "bad.safetensors", lambda t: t.__setitem__(key, torch.tensor(True)))
    run = _merge(capsys, tiny2_file, bad, tmp_path / "out")
    assert run.code == 2 and key in json.loads(run.out)["error"] and "boolean" in json.loads(run.out)["error"]
    assert leftovers(tmp_path / "out") == []


def test_an_adapter_with_no_tensors_is_refused_not_a_silent_copy(tiny2_file, tmp_path, capsys):
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    run = _merge(capsys, tiny2_file, empty, tmp_path / "out")
    assert run.code == 2, run.err
    assert "no tensors" in json.loads(run.out)["error"]
    assert leftovers(tmp_path / "out") == []


def test_lora_factors_that_do_not_chain_are_refused(base, tiny2_file, tmp_path, capsys):
    adapter, _ = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1)
    key = next(k for k in load_file(str(adapter)) if k.endswith("lora_down.weight"))
    bad = _rewritten(adapter, tmp_path / "bad.safetensors", lambda t: t.__setitem__(key, t[key][0].contiguous()))
    for verb in ("merge", "convert"):
        out = tmp_path / f"out-{verb}"
        run = (_merge(capsys, tiny2_file, bad, out) if verb == "merge" else
               run_port(capsys, "convert", bad, "--out", out, "--json"))
        assert run.code == 2, run.err
        assert key in json.loads(run.out)["error"] and "do not chain" in json.loads(run.out)["error"]
        assert leftovers(out) == []


def test_skip_alpha_drops_the_alphas_not_the_modules(base, tiny2_file, tmp_path, capsys):
    """`--skip '*.alpha'`: every module still merges, scaled by 1 instead of alpha / rank."""
    adapter, parts = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1)
    alphas = [k for k in load_file(str(adapter)) if k.endswith(".alpha")]
    no_alpha = _rewritten(adapter, tmp_path / "no-alpha.safetensors",
                          lambda t: [t.pop(k) for k in alphas])
    run = _merge(capsys, tiny2_file, adapter, tmp_path / "skipped", "--skip", "*.alpha")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert sorted(doc["skipped"][str(adapter)]) == sorted(alphas)
    assert run_port(capsys, "merge", tiny2_file, no_alpha, "--out", tmp_path / "plain").code == 0
    a = load_file(str(next((tmp_path / "skipped").glob("*.safetensors"))))
    b = load_file(str(next((tmp_path / "plain").glob("*.safetensors"))))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    base_weights = load_file(str(tiny2_file))
    assert not torch.equal(a[MODULE + ".weight"], base_weights[MODULE + ".weight"])  # the module did merge


def test_skipping_every_module_is_refused_not_a_silent_copy(base, tiny2_file, tmp_path, capsys):
    adapter, _ = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1)
    run = _merge(capsys, tiny2_file, adapter, tmp_path / "out", "--skip", "lora_unet_*")
    assert run.code == 2, run.err
    assert "no adapter module is left" in json.loads(run.out)["error"]
    assert leftovers(tmp_path / "out") == []


def test_inspect_base_holding_nan_is_refused_not_ok(base, tiny2_file, tmp_path, capsys):
    adapter, _ = adapter_for(tmp_path / "a.safetensors", BY_NAME["kohya"], base, seed=1)
    key = MODULE + ".weight"

    def poison(t):
        w = t[key].clone()
        w[0, 0] = float("nan")
        t[key] = w
    bad_base = _rewritten(tiny2_file, tmp_path / "nan-base.safetensors", poison)
    run = run_port(capsys, "inspect", adapter, "--base", bad_base, "--json")
    assert run.code == 1, run.err
    error = json.loads(run.out)["error"]
    assert key in error and "NaN" in error


def test_a_reserved_job_name_is_refused_as_reserved(tmp_path):
    """Issue 29 rule 5: `_batch` is a plain folder name, and reserved; the refusal says the second."""
    from porting.cli.batch.jobs import load_jobs
    from porting.errors import UsageError

    jobs = tmp_path / "jobs.toml"
    jobs.write_text('[[job]]\nname = "_batch"\nsource = "x.safetensors"\n')
    with pytest.raises(UsageError, match="reserved"):
        load_jobs(jobs, {})


def _halves_broken(naming: str, change):
    def apply(t):
        key = next(k for k in sorted(t) if k.endswith(change[0]))
        change[1](t, key)
    return apply


@pytest.mark.parametrize("naming, suffix, damage, phrase", [
    # a LoKr half that does not chain with its partner (w2_a [rows, 2] against a w2_b of 3 rows)
    ("lycoris-lokr", "lokr_w2_b", lambda t, k: t.__setitem__(k, torch.cat([t[k], t[k][:1]]).contiguous()),
     "do not chain"),
    ("bfl-lokr", "lokr_w2_a", lambda t, k: t.__setitem__(k, t[k][:, 0].contiguous()), "do not chain"),  # 1-D half
    # a LoKr factor given whole and as halves: mismatched parts
    ("lycoris-lokr", "lokr_w2_a", lambda t, k: t.__setitem__(k.replace("w2_a", "w2"), torch.ones(2, 2)),
     "both whole"),
    # LoHa: halves that chain but whose two products disagree
    ("kohya-loha", "hada_w2_b", lambda t, k: t.__setitem__(k, t[k][:, :-1].contiguous()), "do not match"),
])
@pytest.mark.parametrize("verb", ["convert", "merge"])
def test_lycoris_factors_that_do_not_chain_are_refused_at_read(base, tiny2_file, tmp_path, capsys, naming, suffix,
                                                               damage, phrase, verb):
    adapter, _ = adapter_for(tmp_path / "a.safetensors", BY_NAME[naming], base, seed=1)
    bad = _rewritten(adapter, tmp_path / "bad.safetensors", _halves_broken(naming, (suffix, damage)))
    out = tmp_path / "out"
    run = (_merge(capsys, tiny2_file, bad, out) if verb == "merge" else
           run_port(capsys, "convert", bad, "--out", out, "--json"))
    assert run.code == 2, run.err
    error = json.loads(run.out)["error"]
    assert phrase in error and str(bad) in error, error
    assert leftovers(out) == []
