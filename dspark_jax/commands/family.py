"""A command made of subcommands, each a module of its own (`plan train`, `bench serve`): the table
of subcommands, their listing, and the dispatch to the one asked for, importing only that module
(the listing and every --help need no JAX)."""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Sub(NamedTuple):
    module: str  # holds `main(argv) -> int`
    summary: str


def usage(command: str, subs: dict[str, Sub]) -> str:
    width = max(map(len, subs))
    lines = [f"usage: python -m dspark_jax {command} <subcommand> [options]", "", "subcommands:"]
    return "\n".join(lines + [f"  {name:<{width}}  {s.summary}" for name, s in subs.items()])


def dispatch(command: str, subs: dict[str, Sub], argv) -> int:
    """Run the subcommand named first in `argv` with the rest; the listing for none or --help
    (status 2 for none: a script that forgot the subcommand should not pass)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(command, subs))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in subs:
        print(f"error: unknown subcommand {name!r} of {command}\n\n{usage(command, subs)}", file=sys.stderr)
        return 2
    module = subs[name].module
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        print(f"error: {command} {name} is not available in this version ({module} is missing)", file=sys.stderr)
        return 2
    return int(mod.main(rest) or 0)
