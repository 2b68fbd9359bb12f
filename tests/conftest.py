"""Session fixtures: tiny checkpoints written once per run (real files on disk, no network)."""

from __future__ import annotations

import pytest

from .helpers import TINY2, reference_model, save_state


@pytest.fixture(scope="session")
def tiny2_state():
    """A tiny FLUX.2 [klein]-shaped reference model's weights (original naming, fp32)."""
    return reference_model(TINY2, seed=1).state_dict()


@pytest.fixture(scope="session")
def tiny2_file(tmp_path_factory, tiny2_state):
    """The same weights as an original-naming .safetensors file (bf16, as published checkpoints are)."""
    import torch

    return save_state(tmp_path_factory.mktemp("tiny2") / "klein-tiny.safetensors", tiny2_state, torch.bfloat16)


@pytest.fixture(scope="session")
def port(tmp_path_factory):
    """A tiny offline port (base, fine-tune, converted transformer, report fixtures), built once per run."""
    from .tinyport import build_tiny_port

    return build_tiny_port(tmp_path_factory.getbasetemp() / "tiny-port")


@pytest.fixture(autouse=True)
def _caller_columns_unset(monkeypatch):
    """Messages wrap to $COLUMNS when it is set (porting.text.for_console): a test sees a width only where it sets
    one, not the one the shell that ran pytest exported."""
    monkeypatch.delenv("COLUMNS", raising=False)
