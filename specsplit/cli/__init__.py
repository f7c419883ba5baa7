"""The `specsplit` command: fetch-model (and the native kernels), up, serve, generate, bench, distill.

One module per family of commands; each adds its sub-commands with `add(sub)` and names the
function that runs them (`set_defaults(run=...)`)."""

from __future__ import annotations

import sys

from specsplit.cli import measure, models, serve, stack
from specsplit.cli.flags import Parser
from specsplit.errors import UsageError


def parser() -> Parser:
    p = Parser(prog="specsplit", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for family in (models, serve, stack, measure):
        family.add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if hasattr(a, "before_imports"):  # `serve`: before anything imports torch (and with it libgomp)
        a.before_imports()
    try:
        return a.run(a)
    except (UsageError, FileNotFoundError, IsADirectoryError, PermissionError) as e:  # a bad flag or file
        print(f"specsplit {a.command}: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:  # a service that died, a model that does not fit
        print(f"specsplit {a.command}: {e}", file=sys.stderr)
        return 1
