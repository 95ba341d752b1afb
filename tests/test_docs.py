"""The docs hold every config key exactly as the dataclasses document it, and the README's
commands and links point at what exists."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from rlsys.config.docs import SCHEMAS, config_rows, markdown

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_config_key_tables_are_current():
    text = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- config-keys:start -->\n(.*)<!-- config-keys:end -->", text, re.S)
    assert block, "docs/configuration.md lost its config-keys markers"
    assert block.group(1) == markdown(), "regenerate with: python -m rlsys.config.docs"


def test_every_config_key_has_a_description():
    for schema in SCHEMAS.values():
        for key, _, _, description in config_rows(schema):
            assert description, f"{key} has no docstring"


def test_the_readme_commands_and_links_exist():
    """The two commands the README gives (the main job and the tests, which CI runs) and every
    relative link of the README and the docs."""
    text = README.read_text()
    for command in ("bash examples/arith/run.sh", "bash scripts/test.sh"):
        assert command in text and (ROOT / command.split()[1]).is_file(), command
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    assert len(text.splitlines()) <= 250, "the README is for a newcomer: keep it short, details go to docs/"


def test_the_not_yet_row_names_every_refusal_of_an_unbuilt_feature():
    """Every limit of rlsys/config/limits.py is named in the README's "Not yet" row and refused somewhere
    through `not_built`, and no other refusal says that something is not built (yet)."""
    from rlsys.config import limits

    row = next(line for line in README.read_text().splitlines() if line.startswith("| Not yet |"))
    sources = {path: path.read_text() for path in sorted((ROOT / "rlsys").rglob("*.py")) if path.name != "limits.py"}
    for name, limit in limits.LIMITS.items():
        assert limit.feature in row, f"the README's Not yet row does not name {name}: {limit.feature!r}"
        assert any(len(re.findall(rf"\b{name}\b", text)) > 1 for text in sources.values()), f"{name}: refused nowhere"
    unlimited = [f"{path.relative_to(ROOT)}:{line}: {words!r}" for path, text in sources.items()
                 for line, words in _unlimited_refusals(ast.parse(text))]
    assert not unlimited, f"refusals of unbuilt features outside a limit (rlsys/config/limits.py): {unlimited}"


def _unlimited_refusals(tree: ast.Module) -> list[tuple[int, str]]:
    """The strings of a module (docstrings aside) that say something is not built (yet), outside the
    `not_built` calls that name their limit."""
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    limited = {id(part) for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "id", "") == "not_built" for part in ast.walk(node)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | limited
            and re.search(r"\bnot built\b|(?<!written )\byet\b", node.value)]
