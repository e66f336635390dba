#!/usr/bin/env python3
"""Sums GoogleTest JUnit XML reports: prints 'N test cases: P passed, F failed, S skipped'.

Usage: test_totals.py LABEL FILE_OR_DIR...   (directories are searched for test.xml/*.xml)
"""
import pathlib
import sys
import xml.etree.ElementTree as ET


def main() -> int:
    label, paths = sys.argv[1], sys.argv[2:]
    files = []
    for p in map(pathlib.Path, paths):
        files += sorted(p.rglob("*.xml")) if p.is_dir() else [p]
    total = failed = skipped = 0
    for f in files:
        for case in ET.parse(f).getroot().iter("testcase"):
            total += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.get("result") == "skipped" or case.find("skipped") is not None or \
                    case.get("status") == "notrun":
                skipped += 1
    print(f"{label}: {total} test cases: {total - failed - skipped} passed, {failed} failed, "
          f"{skipped} skipped (no GPU here for the _CUDA cases)" if skipped else
          f"{label}: {total} test cases: {total - failed} passed, {failed} failed")
    return 1 if failed or total == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
