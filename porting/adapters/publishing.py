"""Adapters carried by `port publish`: folders `port convert ADAPTER` wrote, placed under `adapters/NAME/`.

Each must be a diffusers-named adapter whose every module fits the published transformer (checked from shapes);
the model card gains a section saying how to load it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from porting._files import read_json_object
from porting.errors import InputError
from porting.paths import check_plain_name, check_within, link_roots

from . import LORA_FILE, MANIFEST


def adapter_name(folder: Path) -> str:
    return folder.resolve().name


def check_adapters(folders: Sequence[Path], transformer_cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The converted adapter folders' manifests, after checking each fits the transformer config."""
    from porting.families import get_family
    from porting.inputs import open_source

    from .delta import delta_shape

    out, names = [], set()
    for folder in folders:
        manifest_path, file = folder / MANIFEST, folder / LORA_FILE
        if not manifest_path.is_file() or not file.is_file():
            raise InputError(f"{folder}: not an adapter folder written by port convert (needs {MANIFEST} and "
                             f"{LORA_FILE}).", hint="Convert the adapter first: port convert ADAPTER --out DIR.")
        manifest = read_json_object(manifest_path, "written by port convert")
        check_plain_name(manifest.get("file", LORA_FILE), manifest_path, "file")
        if manifest.get("to") != "diffusers":
            raise InputError(f"{folder}: adapter was converted to {manifest.get('to')} naming; a diffusers pipeline "
                             "needs diffusers naming.", hint="Convert it again without --to original.")
        if adapter_name(folder) in names:
            raise InputError(f"{folder}: two adapters are named {adapter_name(folder)!r}.")
        names.add(adapter_name(folder))
        adapter = open_source(file, kind="adapter").adapter
        shapes = get_family(adapter.table.name).expected_shapes(transformer_cfg, "diffusers")
        for m in adapter.modules.values():
            if shapes.get(m.param) != delta_shape(adapter, m):
                raise InputError(f"{file}: module {m.module} {list(delta_shape(adapter, m))} does not fit the "
                                 f"transformer ({list(shapes[m.param]) if m.param in shapes else 'absent'}).",
                                 hint="Publish the adapter with the base it was trained for.")
        out.append({"folder": folder, **manifest})
    return out


def adapter_sources(adapters: Sequence[Mapping[str, Any]]) -> list[tuple[Path, Path]]:
    """(source file, path inside the published folder) for each adapter's files; each must lie, links resolved,
    inside its adapter folder."""
    out = []
    for a in adapters:
        folder = Path(a["folder"])
        for name in (LORA_FILE, MANIFEST):
            check_within(folder / name, link_roots(folder), "adapter file")
            out.append((folder / name, Path("adapters") / adapter_name(folder) / name))
    return out


def card_section(repo: str, adapters: Sequence[Mapping[str, Any]]) -> str:
    """The card's adapter section; every value read from an adapter's manifest is escaped (`_md` in prose and
    cells, `_code` in code spans, JSON string literals in the Python snippet)."""
    from porting.text import markdown_code as _code
    from porting.text import markdown_text as _md

    if not adapters:
        return ""
    lines = ["## Adapters", "", "Converted by `port convert` to diffusers / peft naming (every module loads; scales "
             "folded in, so the strength below is the trained one):", "",
             "| adapter | converted from | modules | file sha256 |", "|---|---|---|---|"]
    for a in adapters:
        kinds = a.get("kinds") if isinstance(a.get("kinds"), dict) else {}
        kinds_text = _md(", ".join(f"{n} {k}" for k, n in kinds.items()))
        lines.append(f"| `{_code('adapters/' + adapter_name(Path(a['folder'])))}` | {_md(a.get('format'))} "
                     f"(`{_code(Path(str(a.get('source'))).name)}`) | {kinds_text} | `{_code(a.get('sha256'))}` |")
    first = adapter_name(Path(adapters[0]["folder"]))
    name, sub = json.dumps(first), json.dumps(f"adapters/{first}")
    lines += ["", "```python", f"pipe.load_lora_weights({json.dumps(repo)}, subfolder={sub}, adapter_name={name})",
              f"pipe.set_adapters([{name}], adapter_weights=[1.0])  # strength",
              "image = pipe(prompt=\"a red fox in the snow\").images[0]", "```", "",
              f"or bake it in: `{_code(f'port merge BASE adapters/{first}/{LORA_FILE} --out merged --to diffusers')}`.",
              ""]
    return "\n".join(lines)
