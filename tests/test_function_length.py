"""No function in porting/ or validation/ is longer than 80 lines (def to last line, decorators not counted) unless a
`# long: <reason>` comment on the line directly above its def (or above its first decorator) says why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("porting", "validation")
LIMIT = 80
MARK = "# long:"

def long_functions(source: str, path: str) -> list[tuple[str, str]]:
    """(`path:qualified name`, `path:line name (N lines)`) of each function in `source` over LIMIT lines without a
    `# long:` reason above it."""
    lines = source.splitlines()
    found: list[tuple[str, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                top = min([child.lineno] + [d.lineno for d in child.decorator_list])
                above = lines[top - 2].strip() if top >= 2 else ""
                if length > LIMIT and not above.startswith(MARK):
                    found.append((f"{path}:{name}", f"{path}:{child.lineno} {name} ({length} lines)"))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def test_no_function_is_over_80_lines_without_a_reason() -> None:
    found = []
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            found += [shown for _, shown in long_functions(file.read_text(encoding="utf-8"), path)]
    assert not found, ("functions over 80 lines (carve named helpers, or put `# long: <reason>` on the line above "
                       "the def):\n" + "\n".join(found))


def _body(n: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(n))


def test_the_check_sees_a_long_function_and_honours_a_reason() -> None:
    long_one = "def f():\n" + _body(LIMIT)  # def line + 80 = 81 lines
    assert long_functions(long_one, "m.py") == [("m.py:f", "m.py:1 f (81 lines)")]
    assert long_functions("def f():\n" + _body(LIMIT - 1), "m.py") == []  # exactly 80 lines
    assert long_functions("# long: a table of options\n" + long_one, "m.py") == []
    decorated = "import functools\n\n\n# long: a table\n@functools.cache\n" + long_one
    assert long_functions(decorated, "m.py") == []
    nested = "class C:\n    def g(self):\n" + "".join(f"    {line}\n" for line in _body(LIMIT).splitlines())
    assert long_functions(nested, "m.py") == [("m.py:C.g", "m.py:2 C.g (81 lines)")]
    apart = "# long: too far up\n\n" + long_one  # the reason must be directly above
    assert [shown for _, shown in long_functions(apart, "m.py")] == ["m.py:3 f (81 lines)"]
