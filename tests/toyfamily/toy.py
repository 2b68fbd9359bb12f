"""The toy family's module: what its table cannot say."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from porting.families import Family


class Toy(Family):
    name = "toy"
    title = "Toy"
    table_resource = "toy.toml"
    shapes_resource = "toy.shapes.toml"
    structural_fields = ("num_layers", "width")

    def derive_config(self, facts: Mapping[str, Any]) -> dict[str, Any]:
        return {"_class_name": self.diffusers_class, "num_layers": int(facts["num_layers"]),
                "width": int(facts["width"]), "in_features": int(facts["in_features"])}


def make() -> Toy:
    return Toy(folder=Path(__file__).parent)
