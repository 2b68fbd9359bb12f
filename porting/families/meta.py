"""A diffusers model's tensor shapes from the model itself, instantiated on the meta device (no memory)."""

from __future__ import annotations

from typing import Any, Mapping

Shape = tuple[int, ...]


def meta_state_shapes(class_name: str, config: Mapping[str, Any]) -> dict[str, Shape]:
    """Shapes of every tensor of the diffusers model, instantiated on the meta device (no memory)."""
    import logging

    import diffusers
    import torch

    cls = getattr(diffusers, class_name)
    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    log = logging.getLogger("diffusers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with torch.device("meta"):
            model = cls.from_config(clean)
    finally:
        log.setLevel(level)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
