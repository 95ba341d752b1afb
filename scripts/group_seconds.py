"""The seconds each xdist group of the suite took in a run, for the order the next runs hand them out
(tests/group_order.py): read from the test spans a run of scripts/test.sh leaves in its start-up
directory (printed at the end of its report), written as tests/group_seconds.json.

    python scripts/group_seconds.py /tmp/rlsys-startups-XXXX
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "group_seconds.json"


def group_seconds(startup_dir: str) -> dict[str, int]:
    seconds: Counter[str] = Counter()
    for path in glob.glob(os.path.join(startup_dir, "tests-*.jsonl")):
        for line in open(path):
            span = json.loads(line)
            if "@" in span["test"]:  # xdist's suffix: the test's group
                seconds[span["test"].rsplit("@", 1)[1]] += span["end"] - span["start"]
    return {group: round(total) for group, total in seconds.most_common()}


if __name__ == "__main__":
    if len(sys.argv) != 2 or not glob.glob(os.path.join(sys.argv[1], "tests-*.jsonl")):
        sys.exit("usage: python scripts/group_seconds.py STARTUP_DIR (a directory holding tests-*.jsonl)")
    OUT.write_text(json.dumps(group_seconds(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {OUT}")
