"""The order xdist hands out the suite's groups (`--dist loadgroup`): the longest first, by the seconds
each took in a measured run (tests/group_seconds.json, written by scripts/group_seconds.py); a group
not measured yet counts a second per test, and single tests come last. Longest-first keeps the two
workers' ends close: xdist's own order (by count of tests) handed out a group of two 150 s tests last,
which then ran alone. scripts/test.sh turns that order off (`--no-loadscope-reorder`), so xdist takes
the groups as collected here."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

SECONDS: dict[str, float] = json.loads((Path(__file__).parent / "group_seconds.json").read_text())


def group_of(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return marker.args[0] if marker.args else marker.kwargs.get("name")


def pytest_collection_modifyitems(items) -> None:
    groups = [group_of(item) for item in items]
    tests = Counter(groups)
    weight = {group: SECONDS.get(group, float(tests[group])) for group in tests if group is not None}
    order = sorted(range(len(items)), key=lambda i: -weight.get(groups[i], 0.0))  # stable: a group keeps its order
    items[:] = [items[i] for i in order]
