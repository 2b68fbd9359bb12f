"""The adapter input kind: `port convert` and `port inspect` route an adapter file here (headers decide)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ._output import Output

if TYPE_CHECKING:
    from rich.table import Table

    from porting.inputs import Source


def convert(output: Output, src: Source, out: Optional[Path], to: str, style: Optional[str], materialise: bool,
            config: Optional[Path], dry_run: bool, force: bool) -> None:
    from rich.table import Table

    from porting.adapters.convert import convert_adapter
    from porting.errors import PortError
    from porting.inputs.detect import load_base_config

    if out is None and not dry_run:
        raise PortError("port convert needs --out DIR (or --dry-run to only print the plan).")
    result = convert_adapter(src, None if dry_run else out, to=to, style=style, materialise=materialise,
                             config=load_base_config(config) if config else None, force=force,
                             inputs={"--config": config})
    doc = result.to_dict()
    output.document(doc)
    table = Table(title="adapter conversion", show_header=False)
    table.add_row("format", f"{doc['format']} ({doc['from']} naming)")
    table.add_row("to", f"{doc['to']} naming, {doc['style']} keys")
    table.add_row("modules", f"{doc['modules_in']} -> {doc['modules_out']} ({_counts(doc['kinds'])})")
    if doc["materialised"]:
        table.add_row("materialised", f"{len(doc['materialised'])} module(s) as exact deltas")
    if result.out:
        table.add_row("written", f"{result.out / str(result.file)}")
        table.add_row("sha256", str(result.sha256))
    output.table(table)
    if result.out and to == "diffusers":
        output.hint(f"load it with pipe.load_lora_weights({str(result.out)!r})")


def inspect(output: Output, source: Source, base: Optional[Path] = None, strength: Optional[float] = None) -> None:
    """`port inspect ADAPTER [--base BASE]`: `base` (resolved, not opened yet) is opened once, for the effect."""
    from rich.table import Table

    from porting.adapters.describe import describe_adapter
    from porting.compat import adapter_runtimes

    from ._compat import compatibility_table
    from ._options import require_finite

    strength = require_finite(1.0 if strength is None else strength, "--strength")
    path = source.path
    info = describe_adapter(source)
    info["compatibility"] = [v.to_dict() for v in adapter_runtimes(path, info)]
    if base is not None:
        from porting.adapters.base_effect import effect_on_base
        from porting.inputs import open_source

        info["effect"] = effect_on_base(source, open_source(base, kind="weights"), strength)
    output.document(info)
    table = Table(title=f"{path}", show_header=False)
    table.add_row("kind", f"adapter ({info['format']})")
    table.add_row("family", info["family"])
    table.add_row("naming", f"{info['naming']}, {info['key_style']} keys, prefix {info['prefix'] or '(none)'}")
    table.add_row("modules", f"{info['modules']} ({_counts(info['kinds'])})")
    table.add_row("ranks", _counts(info["ranks"]))
    table.add_row("alphas", _counts(info["alphas"]))
    table.add_row("scale alpha/rank", _counts(info["scales"]))
    table.add_row("fits", ", ".join(info["fits"]) or "no released variant")
    for name, why in info["does_not_fit"].items():
        table.add_row(f"not {name}", why)
    table.add_row("dtypes", _counts(info["dtypes"]))
    for target, n in info["targets"].items():
        table.add_row("targets", f"{target} x{n}")
    output.table(table)
    output.table(compatibility_table(info))
    if "effect" in info:
        output.table(effect_table(info["effect"]))
        flagged = [r for r in info["effect"]["modules"] if r["status"] != "ok"]
        if flagged:
            output.warning(f"{len(flagged)} module(s) of {path.name} would not change the bf16 weights of the base "
                           f"at strength {strength:g} (" + ", ".join(f"{r['module']}: {r['status']}"
                                                                    for r in flagged[:4])
                           + (" ..." if len(flagged) > 4 else "") + ")")
    for row in info["unreadable"][:20]:
        output.warning(f"{row['key']}: {row['why']}")


def effect_table(doc: dict[str, Any]) -> Table:
    """The summary of an adapter's effect on a base (`porting.adapters.effect`) as a table."""
    from rich.table import Table

    from porting.adapters.effect import summary_lines

    lines = summary_lines(doc)
    table = Table(title=f"effect on {doc.get('base', 'the base')} at strength {doc.get('strength', 1):g}",
                  show_header=False)
    table.add_row("summary", lines[0].split(": ", 1)[1])
    for line in lines[1:]:
        label, _, rest = line.strip().partition(": ")
        table.add_row(label, rest)
    table.add_row("threshold", doc["definition"])
    return table


def _counts(counts: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or "-"
