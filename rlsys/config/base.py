"""What every config section shares: unknown keys are refused, and each field's attribute
docstring is its documentation."""

from pydantic import ConfigDict

STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True)
