"""Recognise a checkpoint from its header alone: naming, prefix, family, variant and the full diffusers config."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from porting._files import read_config
from porting.errors import ConfigMismatchError, InputError, InternalError, UnknownArchitectureError
from porting.families import Family, builtin_tables, families, family_for
from porting.families.mapping import NAMINGS, MappingTable, Naming
from porting.tensors.checkpoint import Checkpoint

# Prefixes added by training and UI tools (ComfyUI saves `model.diffusion_model.`).
KNOWN_PREFIXES = ("", "model.diffusion_model.", "diffusion_model.", "model.", "net.")

@dataclass
class Detection:
    table: MappingTable
    naming: Naming
    prefix: str
    config: dict[str, Any]  # diffusers config for table.diffusers_class
    variant: str
    inferred: dict[str, Any] = field(default_factory=dict)  # raw facts read from shapes
    respelled: dict[str, str] = field(default_factory=dict)  # stored key -> the table's spelling (`[aliases]`)
    view: Checkpoint | None = field(default=None, repr=False)  # the checkpoint as the table spells it

    @property
    def ckpt(self) -> Checkpoint:
        """The detected checkpoint with its keys as the table spells them (what plans and reads address)."""
        if self.view is None:
            raise InternalError("a Detection built by hand has no checkpoint view.")
        return self.view

    @property
    def family(self) -> Family:
        return family_for(self.table)

    @property
    def naming_label(self) -> str:
        return f"{self.naming} (prefix {self.prefix!r})" if self.prefix else self.naming


def _find_naming(ckpt: Checkpoint, tables: Mapping[str, MappingTable]) -> tuple[MappingTable, Naming, str] | None:
    """The one table, naming and prefix whose markers are all present; two tables claiming a file is refused."""
    keys = set(ckpt.tensors)
    found: list[tuple[MappingTable, Naming, str]] = []
    for name in sorted(tables):
        table = tables[name]
        for naming in NAMINGS:
            prefix = next((p for p in KNOWN_PREFIXES if all(p + m in keys for m in table.detect[naming])), None)
            if prefix is not None:
                found.append((table, naming, prefix))
                break
    if len(found) > 1:
        claims = ", ".join(f"{t.name} ({n} naming)" for t, n, _ in found)
        raise UnknownArchitectureError(f"{ckpt.path}: more than one mapping table claims this checkpoint: {claims}.",
                                       hint="The tables' detection markers overlap; this is a bug in the tables. "
                                            "Pass the table to use explicitly, or report it.")
    return found[0] if found else None


def known_families() -> str:
    return " and ".join(f"{f.title} ({', '.join(f.table.variants[i]['name'] for i in range(len(f.table.variants)))})"
                        for f in families())


def _unknown_architecture(ckpt: Checkpoint, tables: Mapping[str, MappingTable]) -> UnknownArchitectureError:
    keys = sorted(ckpt.tensors)
    markers = [(t.name, n, m) for t in tables.values() for n in NAMINGS for m in t.detect[n]]
    lines = []
    for name, naming, marker in markers:
        close = difflib.get_close_matches(marker, keys, n=1, cutoff=0.6)
        lines.append(f"  {name} {naming}: needs {marker!r}" + (f" (closest here: {close[0]!r})" if close else ""))
    sample = ", ".join(repr(k) for k in keys[:8])
    return UnknownArchitectureError(
        f"{ckpt.path}: keys match no known architecture ({len(keys)} tensors, e.g. {sample}).",
        hint=f"flux-port knows {known_families()} transformers in original or diffusers naming. Is this a LoRA, "
             "a VAE, a text encoder or a full pipeline file?",
        details="Markers not found:\n" + "\n".join(lines))


def _block_count(ckpt_keys: list[str], table: MappingTable, naming: Naming, placeholder: str) -> int:
    pattern = table.block_patterns(naming)[placeholder]
    indices = {int(m.group(1)) for k in ckpt_keys if (m := pattern.match(k))}
    return max(indices) + 1 if indices else 0


def infer_facts(ckpt: Checkpoint, table: MappingTable, naming: Naming, prefix: str) -> dict[str, Any]:
    keys = [k[len(prefix):] for k in ckpt.tensors if k.startswith(prefix)]
    facts: dict[str, Any] = {}
    for name, (key, dim) in table.infer[naming].items():
        info = ckpt.tensors.get(prefix + key)
        if info is None or dim >= len(info.shape):
            raise InputError(f"{ckpt.path}: cannot infer {name}: tensor {key!r} is missing or has the wrong rank "
                             f"({list(info.shape) if info else 'absent'}).",
                             hint="Pass the base model's config with --config.")
        facts[name] = info.shape[dim]
    for flag, keys_by_naming in table.present.items():
        facts[flag] = (prefix + keys_by_naming[NAMINGS.index(naming)]) in ckpt.tensors
    for placeholder, config_field in table.blocks.items():
        facts[config_field] = _block_count(keys, table, naming, placeholder)
    return facts


def match_variant(table: MappingTable, config: Mapping[str, Any]) -> str:
    for variant in table.variants:
        if all(config.get(k) == v for k, v in variant["match"].items()):
            return variant["name"]
    return f"custom {table.name}"


def load_base_config(path: str | Path) -> dict[str, Any]:
    """A base model folder (its transformer/config.json), a model folder, or a config.json file."""
    path = Path(path)
    for candidate in (path / "transformer" / "config.json", path / "config.json", path):
        if candidate.is_file():
            return read_config(candidate, "a diffusers transformer config: a JSON object")
    raise InputError(f"{path}: no transformer/config.json or config.json found.",
                     hint="Point --config at a diffusers base model folder or its transformer/config.json.")


def detect(ckpt: Checkpoint, base_config: Mapping[str, Any] | None = None,
           tables: Mapping[str, MappingTable] | None = None) -> Detection:
    """Identify the checkpoint and build its diffusers config from shapes (no tensor data is read).

    Keys another tool spelled its own way (the table's `[aliases]`) are read as the table spells them, so every verb
    reads them alike: `Detection.ckpt` is that view of `ckpt` (`ckpt` itself is left as it is, so one opened
    checkpoint can be detected again, with another base config or other tables); `Detection.respelled` lists them.
    """
    tables = tables or builtin_tables()
    found = _find_naming(ckpt, tables)
    if found is None:
        raise _unknown_architecture(ckpt, tables)
    table, naming, prefix = found
    respelled = table.respelling(ckpt.tensors, naming, prefix)
    ckpt = ckpt.respelled(respelled)  # another tool's spelling (ComfyUI's saved `.weight` norms) read as the table's
    unprefixed = sorted(k for k in ckpt.tensors if not k.startswith(prefix)) if prefix else []
    try:
        facts = infer_facts(ckpt, table, naming, prefix)
    except InputError:
        if unprefixed:  # the tensor it needs is probably among them: that is the reason to give
            raise _partly_prefixed(ckpt, prefix, unprefixed) from None
        raise
    family = family_for(table)
    config = family.derive_config(facts)
    if ckpt.config and naming == "diffusers" and ckpt.config.get("_class_name") == table.diffusers_class:
        base_config = base_config or ckpt.config  # a diffusers folder brings its own config
    if base_config is not None:
        base_class = base_config.get("_class_name")
        if base_class and base_class != table.diffusers_class:
            raise ConfigMismatchError(f"The base config is for {base_class}, the checkpoint is a "
                                      f"{table.diffusers_class} ({table.name}).")
        bad = family.config_mismatches(base_config, config)
        if bad:
            rows = "\n".join(f"  {n}: base {b!r}, checkpoint {c!r}" for n, b, c in bad)
            raise ConfigMismatchError(
                f"{ckpt.path}: this checkpoint does not fit the base config ({len(bad)} field(s) differ).",
                hint="Check that the fine-tune was trained from this base (klein-4B vs klein-9B?).",
                details=rows, report={"config_mismatch": [dict(field=n, base=b, checkpoint=c) for n, b, c in bad]})
        merged = {k: v for k, v in base_config.items() if not k.startswith("_")}
        config = {"_class_name": table.diffusers_class, **merged}
    if prefix:
        _refuse_partly_prefixed(ckpt, family, config, naming, prefix)
    return Detection(table, naming, prefix, config, match_variant(table, config), facts, respelled, ckpt)


def _refuse_partly_prefixed(ckpt: Checkpoint, family: Any, config: Mapping[str, Any], naming: Naming,
                            prefix: str) -> None:
    """Some of the model's keys under the tool prefix and some without it: say so, instead of reporting the
    unprefixed ones as missing (they are there, under another name)."""
    try:
        expected = set(family.expected_shapes(config, naming))
    except Exception:  # a config the shapes cannot be derived from is reported by the plan, with its reason
        return
    stray = sorted(k for k in ckpt.tensors if not k.startswith(prefix) and k in expected)
    if stray:
        raise _partly_prefixed(ckpt, prefix, stray)


def _partly_prefixed(ckpt: Checkpoint, prefix: str, stray: list[str]) -> InputError:
    under = sum(1 for k in ckpt.tensors if k.startswith(prefix))
    return InputError(f"{ckpt.path}: {under} of the model's keys carry the prefix {prefix!r} and {len(stray)} do not "
                      f"(e.g. {stray[0]!r}); a checkpoint uses one prefix for all its keys. Nothing was written.",
                      hint="The file was assembled from two sources or saved by a broken tool; re-save it with one "
                           "prefix (or none).")
