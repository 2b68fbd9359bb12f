"""Let convert and validate take a recipe name (a workspace folder filled by `port fetch`) instead of paths."""

from __future__ import annotations

from pathlib import Path

from porting.errors import InputError
from porting.hub.workspace import RecipePaths, recipe_paths


def as_recipe(arg: Path, workspace: Path | None) -> RecipePaths | None:
    """The recipe named by `arg` when `arg` is not an existing path but a workspace folder of that name exists."""
    if arg.exists() or len(arg.parts) != 1:
        return None
    try:
        paths = recipe_paths(str(arg), workspace)
    except InputError:
        return None
    return paths if paths.dir.is_dir() else None


def finetune_file(paths: RecipePaths) -> Path:
    files = sorted(paths.finetune.glob("*.safetensors")) if paths.finetune.is_dir() else []
    if len(files) != 1:
        raise InputError(f"{paths.finetune}: expected one .safetensors fine-tune file, found {len(files)}.",
                         hint=f"Run `port fetch {paths.name}` first, or pass the file path to `port convert`.")
    return files[0]


def base_config(paths: RecipePaths) -> Path | None:
    return paths.base if (paths.base / "transformer" / "config.json").is_file() else None


def raise_unfetched_recipe(arg: Path) -> None:
    """A missing SRC that names a shipped recipe means it was not fetched yet: say that, not 'no such file'."""
    from porting.hub.recipes import get_recipe

    if len(arg.parts) != 1:
        return
    try:
        get_recipe(str(arg))
    except InputError:
        return
    raise InputError(f"recipe {arg} is not fetched yet (no workspace folder for it).",
                     hint=f"Fetch it first: port fetch {arg}  (or pass --workspace if it lives elsewhere).")
