"""Known ports as data (recipes.toml): base repo + checkpoint to port, with the variant and pipeline class."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import tomllib

from porting.errors import InputError, MappingTableError
from porting.families import pipeline_variants

from .fetch.globs import compile_glob
from .fetch.sources import HUBS, check_repo_id

FORMAT_VERSION = 1
RECIPE_VARIANTS = ("klein", "klein-kv")  # what fetch + convert + publish are proven on end to end


@dataclass(frozen=True)
class RecipePart:
    """One repository to fetch: which hubs host it, at which revision, and which files."""

    repo: str
    hubs: tuple[str, ...]
    revision: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    files: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"repo": self.repo, "hubs": list(self.hubs), "revision": self.revision, "include": list(self.include),
                "exclude": list(self.exclude), "files": list(self.files)}


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    variant: str
    pipeline: str
    base: RecipePart
    finetune: RecipePart | None

    def parts(self) -> dict[str, RecipePart]:
        return {"base": self.base, **({"finetune": self.finetune} if self.finetune else {})}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "variant": self.variant,
                "pipeline": self.pipeline, **{k: p.to_dict() for k, p in self.parts().items()}}


def _part(recipe: str, key: str, raw: Any) -> RecipePart:
    where = f"recipes.toml [{recipe}.{key}]"
    if not isinstance(raw, dict):
        raise MappingTableError(f"{where} must be a table.")
    unknown = set(raw) - {"repo", "hubs", "revision", "include", "exclude", "files"}
    if unknown:
        raise MappingTableError(f"{where} has unknown field(s): {', '.join(sorted(unknown))}.")
    repo = raw.get("repo")
    if not isinstance(repo, str):
        raise MappingTableError(f"{where} needs repo = \"ORG/NAME\".")
    check_repo_id(repo, where)
    hubs = tuple(raw.get("hubs", ["hf"]))
    if not hubs or any(h not in HUBS for h in hubs):
        raise MappingTableError(f"{where}: hubs must be a non-empty list of {', '.join(HUBS)}; got {list(hubs)}.")
    part = RecipePart(repo=repo, hubs=hubs, revision=raw.get("revision"), include=tuple(raw.get("include", ())),
                      exclude=tuple(raw.get("exclude", ())), files=tuple(raw.get("files", ())))
    if part.files and (part.include or part.exclude):
        raise MappingTableError(f"{where}: give either files or include/exclude, not both.")
    for pattern in part.include + part.exclude:
        compile_glob(pattern)
    return part


def parse_recipes(doc: dict[str, Any]) -> dict[str, Recipe]:
    """Validate a parsed recipes.toml and return the recipes by name."""
    if doc.get("format_version") != FORMAT_VERSION:
        raise MappingTableError(f"recipes.toml has format_version {doc.get('format_version')!r}; "
                                f"this flux-port reads {FORMAT_VERSION}.")
    out: dict[str, Recipe] = {}
    # publish picks the pipeline class from the variant; a recipe must not contradict it
    pipelines = {variant: spec.pipeline for variant, (_, spec) in pipeline_variants().items()
                 if variant in RECIPE_VARIANTS}
    for name, raw in doc.get("recipes", {}).items():
        variant = raw.get("variant")
        if variant not in pipelines:
            raise MappingTableError(f"recipes.toml [{name}]: variant must be one of {', '.join(pipelines)}; "
                                    f"got {variant!r}.")
        pipeline = raw.get("pipeline", pipelines[variant])
        if pipeline != pipelines[variant]:
            raise MappingTableError(f"recipes.toml [{name}]: variant {variant} uses {pipelines[variant]}, "
                                    f"not {pipeline}.")
        if "base" not in raw:
            raise MappingTableError(f"recipes.toml [{name}] needs a [recipes.{name}.base] table.")
        out[name] = Recipe(name=name, description=str(raw.get("description", "")), variant=variant,
                           pipeline=pipeline, base=_part(name, "base", raw["base"]),
                           finetune=_part(name, "finetune", raw["finetune"]) if "finetune" in raw else None)
    return out


@lru_cache(maxsize=1)
def load_recipes() -> dict[str, Recipe]:
    """The recipes shipped with flux-port (porting/recipes.toml)."""
    text = resources.files("porting.hub").joinpath("recipes.toml").read_text(encoding="utf-8")
    return parse_recipes(tomllib.loads(text))


def get_recipe(name: str) -> Recipe:
    recipes = load_recipes()
    if name in recipes:
        return recipes[name]
    close = difflib.get_close_matches(name, list(recipes), n=3)
    hint = (f"Did you mean {', '.join(close)}? " if close else "") + \
        "`port recipes` lists the known ones; a repository is written hf:ORG/NAME or modelscope:ORG/NAME."
    raise InputError(f"{name!r} is neither a known recipe nor a repository source.", hint=hint)
