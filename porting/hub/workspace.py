"""Where a recipe's files live: <root>/<recipe>/{base,finetune,transformer,reports,published}/ and port.json.

The root is `--workspace DIR`, else $FLUX_PORT_HOME, else ./ports. Every verb finds a recipe's folders through
`recipe_paths(name, root)` and records what it did with `record_step(paths, verb, data)`.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from porting._files import parse_json
from porting.errors import InputError
from porting.finite import dumps
from porting.outputs import umask

ENV_HOME = "FLUX_PORT_HOME"
DEFAULT_ROOT = Path("ports")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def workspace_root(root: str | Path | None = None) -> Path:
    """The workspace root: the explicit argument, else $FLUX_PORT_HOME, else ./ports."""
    if root is not None and str(root) != "":
        return Path(root).expanduser()
    env = os.environ.get(ENV_HOME)
    return Path(env).expanduser() if env else DEFAULT_ROOT


@dataclass(frozen=True)
class RecipePaths:
    """The folders and files of one recipe inside the workspace (nothing is created here)."""

    name: str
    root: Path

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def base(self) -> Path:
        return self.dir / "base"

    @property
    def finetune(self) -> Path:
        return self.dir / "finetune"

    @property
    def transformer(self) -> Path:
        return self.dir / "transformer"

    @property
    def reports(self) -> Path:
        return self.dir / "reports"

    @property
    def published(self) -> Path:
        return self.dir / "published"

    @property
    def port_json(self) -> Path:
        return self.dir / "port.json"


def recipe_paths(name: str, root: str | Path | None = None) -> RecipePaths:
    """Paths of recipe `name` under the workspace root (see `workspace_root`)."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise InputError(f"{name!r} is not a valid recipe name.",
                         hint="Use letters, digits, '.', '_' and '-' only; `port recipes` lists the known ones.")
    return RecipePaths(name=name, root=workspace_root(root))


def read_port_json(paths: RecipePaths) -> dict[str, Any]:
    """The recipe's port.json, or an empty record when no verb has run yet."""
    try:
        text = paths.port_json.read_bytes()
    except FileNotFoundError:
        return {}
    return parse_json(text, str(paths.port_json), kind=dict)


def record_step(paths: RecipePaths, verb: str, data: dict[str, Any]) -> Path:
    """Store `data` under `verb` in port.json (replacing that verb's previous record), written atomically."""
    record = read_port_json(paths)
    record.setdefault("format_version", 1)
    record.setdefault("recipe", paths.name)
    record[verb] = data
    paths.dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.port_json, record)
    return paths.port_json


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write JSON to a temporary file next to `path`, then rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; the record is as readable as any other file
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dumps(doc, indent=2, sort_keys=False, default=str))
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


