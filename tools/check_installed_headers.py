#!/usr/bin/env python3
"""Checks an installed amp8 package: every header sits under include/amp8/, and every
`#include "..."` of every installed header resolves to a header installed beside it
(include/amp8/<path>, included as "amp8/<path>"), so a trainer compiling against the package
never reaches for a file that only the source tree has (the implementation's detail/ and cuda/
folders are not installed) nor for one of its own: an include of "ops/...", "plugin/..." or
"recipes/..." without the amp8/ prefix would find a trainer's folder of that name first.

Usage: check_installed_headers.py PREFIX     (after `cmake --install`)
Exits 1, naming each installed header and the include that does not resolve.
"""
import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def main() -> int:
    include = pathlib.Path(sys.argv[1]) / "include"
    root = include / "amp8"
    headers = sorted(root.rglob("*.h"))
    if not headers:
        print(f"installed headers: none under {root}")
        return 1
    problems = []
    for header in headers:
        for included in INCLUDE.findall(header.read_text()):
            if included.split("/")[0] in ("ops", "plugin", "recipes"):
                problems.append(f"{header.relative_to(include)}: #include \"{included}\" lacks the amp8/ prefix")
            elif not ((include / included).is_file() or (header.parent / included).is_file()):
                problems.append(f"{header.relative_to(include)}: #include \"{included}\" is not installed")
    if not (root / "amp8.h").is_file():
        problems.append("amp8/amp8.h is not installed")
    for p in problems:
        print("installed headers:", p)
    print(f"installed headers: {len(headers)} checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
