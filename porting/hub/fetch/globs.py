"""The one glob dialect of --include / --exclude, applied by flux-port to every hub's listing.

The hubs' own filters differ (huggingface_hub: fnmatch where `*` also crosses `/`; modelscope: fnmatch with a
`.*` rewrite), so flux-port filters the listing itself and hands the clients exact file paths. Rules:

- patterns match repository paths (`/`-separated), case-sensitively;
- `*` matches any characters except `/`, `?` one character except `/`, `[abc]` / `[!abc]` one of a set;
- `**` matches any characters including `/` (`**/` also matches no folder at all);
- a pattern without `/` matches a file name in any folder: `*.json` selects `model_index.json` and
  `vae/config.json`;
- a pattern with a `/` is anchored at the repository root: `vae/*.json`, `text_encoder/**`;
- a pattern ending in `/` selects a whole folder: `tokenizer/` is `tokenizer/**`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable

from porting.errors import InputError


@lru_cache(maxsize=256)
def compile_glob(pattern: str) -> re.Pattern[str]:
    """Translate one pattern of the dialect above into an anchored regular expression."""
    if not pattern or pattern.strip() != pattern:
        raise InputError(f"Empty or space-padded glob {pattern!r}.")
    p = pattern[1:] if pattern.startswith("/") else pattern
    if p.endswith("/"):
        p += "**"
    anchored = pattern.startswith("/") or "/" in p
    out: list[str] = []
    i = 0
    while i < len(p):
        c = p[i]
        if p.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif p.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = p.find("]", i + 2 if p[i + 1:i + 2] in ("!", "]") else i + 1)
            if end < 0:
                raise InputError(f"Unclosed '[' in glob {pattern!r}.")
            body = p[i + 1:end]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            out.append("[" + ("^/" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    regex = "".join(out)
    return re.compile(regex if anchored else f"(?:.*/)?{regex}")


def matches(path: str, pattern: str) -> bool:
    return compile_glob(pattern).fullmatch(path) is not None


def select(paths: Iterable[str], include: Iterable[str] = (), exclude: Iterable[str] = ()) -> list[str]:
    """Paths that match at least one include (all paths when there is none) and no exclude, in input order."""
    inc = [compile_glob(p) for p in include]
    exc = [compile_glob(p) for p in exclude]
    return [p for p in paths
            if (not inc or any(r.fullmatch(p) for r in inc)) and not any(r.fullmatch(p) for r in exc)]
