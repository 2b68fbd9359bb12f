"""A diffusers model's tensor shapes from the model itself, its parameters on the meta device (no memory)."""

from __future__ import annotations

from typing import Any, Mapping

Shape = tuple[int, ...]


def meta_state_shapes(class_name: str, config: Mapping[str, Any]) -> dict[str, Shape]:
    """Shapes of every tensor of the diffusers model, built as a skeleton (porting/skeleton.py: no memory)."""
    import diffusers

    from porting.skeleton import diffusers_skeleton

    model = diffusers_skeleton(getattr(diffusers, class_name), config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
