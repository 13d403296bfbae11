"""The benchmark runner: ``python -m benchmarks list | run STUDY [ARGS...] | docs [--check]``
(``benchmarks/README.md``)."""

from __future__ import annotations

import shlex
import subprocess
import sys

from benchmarks.studies import STUDIES


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    verb, rest = argv[0], argv[1:]
    if verb == "list":
        for study in STUDIES.values():
            print(f"{study.name} ({study.machine}): {study.question}\n    {study.command}\n"
                  f"    rows: {', '.join(study.fields)}")
        return 0
    if verb == "docs":
        from benchmarks.docs import main as docs_main

        return docs_main(rest)
    if verb == "run":
        if not rest or rest[0] not in STUDIES:
            print(f"usage: python -m benchmarks run STUDY [ARGS...]; studies: {', '.join(STUDIES)}", file=sys.stderr)
            return 2
        command = shlex.split(STUDIES[rest[0]].command)
        if command[:2] != ["python", "-m"] or any("(" in part for part in command):
            print(f"{rest[0]} runs as: {STUDIES[rest[0]].command} (see benchmarks/README.md)", file=sys.stderr)
            return 2
        return subprocess.call([sys.executable, *command[1:], *rest[1:]])
    print(f"unknown command {verb!r}; use list, run or docs", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
