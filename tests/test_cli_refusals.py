"""Refusals come before the heavy imports: every refusal of a heavy verb that needs no model (option values, names,
counts, sizes, device strings, the form of a repository id) is made by the verb's `preflight`, which
`porting.cli._options.checked` runs before the verb's body imports torch, diffusers or transformers. Each verb's
refusals run in a fresh interpreter (tests/refusals.py); after each, none of those libraries is loaded, and the
refusal is exit 2 with its message. bench/startup.py times the same refusals against `--help`."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest

from porting.cli.app import VERBS

from .refusals import REFUSALS, filled, run_in_child

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("verb", sorted(REFUSALS))
def test_each_refusal_is_made_before_torch_diffusers_or_transformers_is_imported(tmp_path: Path, verb: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    cases = REFUSALS[verb]
    results = run_in_child([[verb, *filled(argv, model, tmp_path / "out"), "--json"] for argv, _ in cases], ROOT)
    for (argv, phrase), result in zip(cases, results):
        assert result["code"] == 2, (verb, argv, result)
        assert phrase in json.loads(result["out"])["error"], (verb, argv, result["out"])
        assert result["heavy"] == [], (verb, argv, f"imported {result['heavy']} before refusing")
    assert not (tmp_path / "out").exists() and list(model.iterdir()) == []


def test_every_verb_that_loads_a_model_library_has_a_preflight_and_refusals_here() -> None:
    """A heavy verb (its body calls `_output.use(..., heavy=True)`) declares its model-free refusals in a
    `preflight` that takes its options as keywords, and has cases in tests/refusals.py."""
    for name, verb in VERBS.items():
        module = importlib.import_module(f"porting.cli.{verb.module}")
        if "heavy=True" not in inspect.getsource(getattr(module, verb.function)):
            continue
        preflight = getattr(module, "preflight", None)
        assert preflight is not None, f"port {name} loads model libraries but has no preflight"
        options = set(inspect.signature(getattr(module, verb.function)).parameters)
        taken = {p.name for p in inspect.signature(preflight).parameters.values() if p.kind is p.KEYWORD_ONLY}
        assert taken <= options, (name, taken - options)
        assert REFUSALS.get(name), f"port {name}: no refusal cases in tests/refusals.py"
