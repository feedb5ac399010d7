#!/usr/bin/env python3
"""Reads the JUnit reports cargo-nextest writes (scripts/test.sh, one per phase).

  junit-summary.py counts FILE...    "<passed> <failed>"
  junit-summary.py failures FILE...  one failed test a line: "<binary> <test>"
  junit-summary.py slowest FILE...   the five test binaries whose tests took longest, added up
"""
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def cases(paths):
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for suite in root.iter("testsuite"):
            for case in suite.iter("testcase"):
                failed = any(child.tag in ("failure", "error") for child in case)
                skipped = any(child.tag == "skipped" for child in case)
                yield suite.get("name", "?"), case.get("name", "?"), float(case.get("time", "0") or 0), failed, skipped


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    what, paths = sys.argv[1], sys.argv[2:]
    rows = list(cases(paths))
    if what == "counts":
        passed = sum(1 for r in rows if not r[3] and not r[4])
        failed = sum(1 for r in rows if r[3])
        print(passed, failed)
    elif what == "failures":
        for suite, name, _, failed, _ in rows:
            if failed:
                print(suite, name)
    elif what == "slowest":
        totals = defaultdict(float)
        for suite, _, seconds, _, _ in rows:
            totals[suite] += seconds
        for suite, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:5]:
            print(f"{seconds:7.1f}  {suite}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
