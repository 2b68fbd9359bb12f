"""The tables `port inspect` ends with: which runtime loads the file, and how the base's companions fit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._output import cell

if TYPE_CHECKING:
    from rich.table import Table


def compatibility_table(info: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title="which runtime loads this file", show_lines=False)
    for column in ("runtime", "loads", "why / how"):
        table.add_column(column, overflow="fold")
    for v in info["compatibility"]:
        how = cell(v["detail"], *([v["command"]] if v["command"] else []))
        table.add_row(v["runtime"], v["status"], how)
    return table


def companions_table(doc: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title=f"beside {doc['base']}")
    for column in ("check", "", "detail"):
        table.add_column(column, overflow="fold")
    for row in doc["checks"]:
        table.add_row(row["check"], "ok" if row["ok"] else "MISMATCH", row["detail"])
    return table
