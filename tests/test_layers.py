"""The layering docs/architecture.md states, checked on the code: every module of `rlsys/` belongs
to one layer of its table, and a module imports only from its own layer or the layers below."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)

ROOT = Path(__file__).resolve().parents[1]


def layers() -> list[list[str]]:
    """The table's package column, top to bottom: each layer's packages and modules as dotted names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## The packages, top to bottom"):].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`rlsys/" in line]
    return [[path.strip("/").removesuffix(".py").replace("/", ".")
             for path in re.findall(r"`(rlsys/[\w/.]*)`", row.split("|")[2])] for row in rows]


def layer_of(module: str, table: list[list[str]]) -> int | None:
    for index, names in enumerate(table):
        if any(module == name or module.startswith(name + ".") for name in names):
            return index
    return None


def imports(path: Path) -> set[str]:
    """The rlsys modules `path` imports, at any depth of the file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "rlsys" or name.startswith("rlsys.")}


def modules() -> dict[str, Path]:
    return {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
            for path in sorted((ROOT / "rlsys").rglob("*.py"))}


def test_every_module_has_a_layer():
    table = layers()
    assert len(table) >= 8, "docs/architecture.md's layer table was not found"
    missing = [name for name in modules() if name != "rlsys" and layer_of(name, table) is None]
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


def test_imports_run_only_downward():
    table = layers()
    upward = []
    for name, path in modules().items():
        here = layer_of(name, table)
        for imported in imports(path):
            there = layer_of(imported, table)
            if here is not None and there is not None and there < here:
                upward.append(f"{name} ({table[here][0]}) imports {imported} ({table[there][0]})")
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)
