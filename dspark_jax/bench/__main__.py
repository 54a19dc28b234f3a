"""Dispatch ``python -m dspark_jax bench <subcommand> [args...]`` to ``dspark_jax.bench.<subcommand>.main``."""

from __future__ import annotations

import importlib
import sys

from dspark_jax.bench import SUBCOMMANDS
from dspark_jax.cli import report_user_errors


def _usage() -> str:
    lines = ["usage: python -m dspark_jax bench <subcommand> [options]", "", "subcommands:"]
    lines += [f"  {name:<8} {hlp}" for name, (_, hlp) in SUBCOMMANDS.items()]
    return "\n".join(lines)


@report_user_errors
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = SUBCOMMANDS[name][0]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        print(f"benchmark {name!r} is not available in this version ({module} is missing)", file=sys.stderr)
        return 2
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
