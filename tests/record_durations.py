"""Writes tests/durations.json, the seconds each test file took in a full run, from that run's
`--durations=0` report:

    pytest --durations=0 > run.log; python tests/record_durations.py run.log

tests/conftest.py hands files to the xdist workers longest first, so the longest never starts
last and ends the run alone. The figures only order the files: stale ones make the run slower,
never a test wrong."""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).with_name("durations.json")
LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(tests/[^:\s]+\.py)::")


def per_file(report: str) -> dict[str, int]:
    seconds: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    return {path: round(s) for path, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if round(s) > 0}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: record_durations.py PYTEST_LOG", file=sys.stderr)
        return 64
    OUT.write_text(json.dumps(per_file(Path(argv[0]).read_text()), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
