"""The README documents every config key, exactly as the dataclasses do."""

from __future__ import annotations

import pathlib
import re

from rlsys.config.docs import markdown

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_tables_are_current():
    text = README.read_text()
    block = re.search(r"<!-- config-keys:start -->\n(.*)<!-- config-keys:end -->", text, re.S)
    assert block, "README lost its config-keys markers"
    assert block.group(1) == markdown(), "regenerate with: python -m rlsys.config.docs"


def test_every_config_key_has_a_description():
    from rlsys.config.docs import SCHEMAS, config_rows

    for schema in SCHEMAS.values():
        for key, _, _, description in config_rows(schema):
            assert description, f"{key} has no docstring"
