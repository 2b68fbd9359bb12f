"""Load mapping tables (mappings/*.toml) and expand them into concrete key-level steps.

A table is the single source of truth for both directions: rules are written original -> diffusers and the
diffusers -> original steps use the inverse of each operation.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping

import tomllib

from porting.errors import MappingTableError
from porting.families.ops import Op, op_from_spec

Naming = Literal["original", "diffusers"]
NAMINGS: tuple[Naming, Naming] = ("original", "diffusers")
PLACEHOLDER = re.compile(r"\{(\w+)\}")
TABLE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Rule:
    original: tuple[str, ...]
    diffusers: tuple[str, ...]
    op: Mapping[str, Any] | None = None
    params: tuple[str, ...] = ()
    when: str | None = None

    def templates(self, naming: Naming) -> tuple[str, ...]:
        return self.original if naming == "original" else self.diffusers


@dataclass(frozen=True)
class Step:
    """One concrete operation: these source keys become these target keys."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    op: Op
    rule_index: int


@dataclass(frozen=True)
class MappingTable:
    name: str
    description: str
    diffusers_class: str
    blocks: Mapping[str, str]  # placeholder -> config field holding its count
    detect: Mapping[str, tuple[str, ...]]
    infer: Mapping[str, Mapping[str, tuple[str, int]]]
    present: Mapping[str, tuple[str, str]]
    variants: tuple[Mapping[str, Any], ...]
    rules: tuple[Rule, ...]
    source: Path | None = field(default=None, compare=False)
    aliases: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)  # naming -> (saved, table)

    def respelling(self, keys: Iterable[str], naming: Naming, prefix: str = "") -> dict[str, str]:
        """Stored key -> the table's spelling, for keys under `prefix` that another tool spelled its own way
        (`[aliases]`); a key whose table spelling is also present is left as it is (the file is then ambiguous and
        the strict plan names it)."""
        keys = set(keys)
        found: dict[str, str] = {}
        for key in keys:
            for saved, ours in self.aliases.get(naming, ()):
                if key.startswith(prefix) and key.endswith(saved):
                    respelled = key[: len(key) - len(saved)] + ours
                    if respelled not in keys:
                        found[key] = respelled
                    break
        return found

    def expand(self, config: Mapping[str, Any], source: Naming) -> list[Step]:
        """All steps for a model of this config, reading keys in `source` naming."""
        steps: list[Step] = []
        seen_targets: dict[str, int] = {}
        for index, rule in enumerate(self.rules):
            if rule.when and not config.get(rule.when):
                continue
            where = f"{self.name}.toml rule {index + 1} ({rule.original[0]})"
            forward = op_from_spec(rule.op, len(rule.original), len(rule.diffusers), config, where)
            op = forward if source == "original" else forward.inverse()
            target: Naming = "diffusers" if source == "original" else "original"
            for values in self._bindings(rule, config):
                src = tuple(t.format(**values) for t in rule.templates(source))
                dst = tuple(t.format(**values) for t in rule.templates(target))
                for key in dst:
                    if key in seen_targets:
                        raise MappingTableError(f"{where}: target {key!r} is also produced by rule "
                                                f"{seen_targets[key] + 1}.")
                    seen_targets[key] = index
                steps.append(Step(src, dst, op, index))
        return steps

    def identity(self, config: Mapping[str, Any], naming: Naming) -> list[Step]:
        """Steps that keep every key of `naming` as it is (re-shard or cast without renaming)."""
        from porting.families.ops import Rename

        other: Naming = "diffusers" if naming == "original" else "original"
        return [Step((key,), (key,), Rename(), step.rule_index)
                for step in self.expand(config, other) for key in step.targets]

    def _bindings(self, rule: Rule, config: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        names = sorted({n for t in rule.original + rule.diffusers for n in PLACEHOLDER.findall(t)})
        ranges = []
        for n in names:
            if n == "p":
                ranges.append(rule.params)
            else:
                ranges.append(range(int(config[self.blocks[n]])))
        for combo in itertools.product(*ranges):
            yield dict(zip(names, combo))

    def block_patterns(self, naming: Naming) -> dict[str, re.Pattern[str]]:
        """For each block placeholder, a regex that captures the index from a key prefix in `naming`."""
        patterns: dict[str, re.Pattern[str]] = {}
        for placeholder in self.blocks:
            for rule in self.rules:
                for template in rule.templates(naming):
                    marker = "{" + placeholder + "}"
                    if marker in template:
                        head = template.split(marker, 1)[0]
                        patterns.setdefault(placeholder, re.compile(re.escape(head) + r"(\d+)\."))
        return patterns


def _as_tuple(value: Any) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, list) else (value,)


def parse_table(data: Mapping[str, Any], source: Path | None = None) -> MappingTable:
    """Validate a table's shape when it is loaded, so a broken table fails before any checkpoint is touched."""
    where = str(source or "mapping table")
    if data.get("format_version") != TABLE_FORMAT_VERSION:
        raise MappingTableError(f"{where}: format_version {data.get('format_version')!r}; this flux-port reads "
                                f"mapping tables of format_version {TABLE_FORMAT_VERSION}.")
    try:
        head = data["table"]
        rules = []
        for i, raw in enumerate(data["rule"]):
            unknown = set(raw) - {"original", "diffusers", "op", "params", "when"}
            if unknown:
                raise MappingTableError(f"{where}: rule {i + 1} has unknown fields {sorted(unknown)}.")
            rule = Rule(_as_tuple(raw["original"]), _as_tuple(raw["diffusers"]), raw.get("op"),
                        tuple(raw.get("params", ())), raw.get("when"))
            for t in rule.original + rule.diffusers:
                for n in PLACEHOLDER.findall(t):
                    if n != "p" and n not in head["blocks"]:
                        raise MappingTableError(f"{where}: rule {i + 1} uses unknown placeholder {{{n}}}.")
                    if n == "p" and not rule.params:
                        raise MappingTableError(f"{where}: rule {i + 1} uses {{p}} without `params`.")
            # arity and op name are checked without sizes
            op_from_spec(rule.op, len(rule.original), len(rule.diffusers), None, f"{where} rule {i + 1}")
            rules.append(rule)
        infer = {n: {k: (v[0], int(v[1])) for k, v in data["infer"][n].items()} for n in NAMINGS}
        present = {k: (v[0], v[1]) for k, v in data["infer"].get("present", {}).items()}
        aliases = _parse_aliases(data.get("aliases", {}), where)
        return MappingTable(
            name=head["name"], description=head.get("description", ""), diffusers_class=head["diffusers_class"],
            blocks=dict(head["blocks"]), detect={n: tuple(data["detect"][n]) for n in NAMINGS}, infer=infer,
            present=present, variants=tuple(data.get("variant", ())), rules=tuple(rules), source=source,
            aliases=aliases)
    except KeyError as e:
        raise MappingTableError(f"{where}: missing field {e}.") from e


def _parse_aliases(raw: Any, where: str) -> dict[str, tuple[tuple[str, str], ...]]:
    if not isinstance(raw, dict) or set(raw) - set(NAMINGS):
        raise MappingTableError(f"{where}: [aliases] holds one table per naming ({', '.join(NAMINGS)}).")
    out = {}
    for naming, pairs in raw.items():
        if not isinstance(pairs, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v and k != v
                                                  for k, v in pairs.items()):
            raise MappingTableError(f"{where}: [aliases.{naming}] maps a saved suffix to the table's suffix "
                                    "(two different non-empty strings).")
        out[naming] = tuple(pairs.items())
    return out


def load_table_file(path: str | Path) -> MappingTable:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MappingTableError(f"{path}: cannot read mapping table ({e}).") from e
    return parse_table(data, path)
