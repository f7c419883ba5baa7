"""Optional dependencies (pyproject's extras): a command that needs one that is missing says which
extra to install, in one line, instead of failing with an ImportError deep inside."""

from __future__ import annotations

import importlib
import importlib.util

from specsplit.errors import UsageError


def require(module: str, extra: str, purpose: str) -> None:
    """Raises UsageError naming the extra when `module` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{purpose} needs the {module!r} package, which is not installed: "
                         f"pip install 'specsplit[{extra}]'")
    importlib.import_module(module)
