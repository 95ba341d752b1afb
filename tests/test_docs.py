"""The docs hold every config key exactly as the dataclasses document it, and the README's
commands and links point at what exists."""

from __future__ import annotations

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
