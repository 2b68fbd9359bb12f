"""`port publish --push`: upload a published folder to the Hugging Face Hub or ModelScope through their own clients,
then check that what landed is what was validated.

The names below are imported from their modules when first used, so that `port publish` checks a --push target
(`target.push_target`, no network) without importing the upload engine and the hub clients behind it."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_MODULE_OF = {"PushResult": "engine", "preflight": "engine", "push_folder": "engine",
              "PUSH_HUBS": "target", "PushTarget": "target", "push_target": "target"}

__all__ = ["PUSH_HUBS", "PushResult", "PushTarget", "preflight", "push_folder", "push_target"]


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
