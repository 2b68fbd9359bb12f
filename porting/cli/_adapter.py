"""The adapter input kind: `port convert` and `port inspect` route an adapter file here (headers decide)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.table import Table

from ._output import Output


def is_adapter(path: Path) -> bool:
    """True when `path` is a safetensors file (or folder) whose keys are mostly adapter factors (headers only)."""
    from porting.adapters.naming import looks_like_adapter
    from porting.errors import PortError
    from porting.tensors.checkpoint import open_checkpoint

    if not path.exists():
        return False
    try:
        return looks_like_adapter(open_checkpoint(path))
    except PortError:
        return False  # the weights path reports what is wrong with the file


def convert(output: Output, src: Path, out: Optional[Path], to: str, style: Optional[str], materialise: bool,
            config: Optional[Path], dry_run: bool, force: bool) -> None:
    from porting.adapters.convert import convert_adapter
    from porting.engine.detect import load_base_config
    from porting.errors import PortError

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


def inspect(output: Output, path: Path) -> None:
    from porting.adapters.describe import describe_adapter
    from porting.compat import adapter_runtimes

    from ._compat import compatibility_table

    info = describe_adapter(path)
    info["compatibility"] = [v.to_dict() for v in adapter_runtimes(path, info)]
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
    for row in info["unreadable"][:20]:
        output.warning(f"{row['key']}: {row['why']}")


def _counts(counts: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or "-"
