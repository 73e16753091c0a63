"""Old import paths that keep working: a moved module's old name forwards every attribute to its new home.

A forwarding module holds one line, ``__getattr__ = moved(__name__, "evenflow.new.home")``; the first lookup of a
name imports the new home (by name, so the old path's package never imports upwards) and warns with a
[`DeprecationWarning`][DeprecationWarning] that names where to import it from. The object returned is the new home's
own, so ``isinstance`` checks, pickles and identity comparisons see one class.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

__all__ = ["moved"]


def moved(old: str, *homes: str) -> Callable[[str], object]:
    """A module ``__getattr__`` for the module once named ``old``: a name is looked up in ``homes`` in order
    (a package whose names were split between modules lists each), with a warning naming the home it was
    found in."""

    def __getattr__(name: str) -> object:
        if name.startswith("__") and name.endswith("__"):  # dunder lookups (__path__, __wrapped__, ...) are not ours
            raise AttributeError(name)
        for home in homes:
            module = importlib.import_module(home)
            if hasattr(module, name):
                warnings.warn(f"{old}.{name} moved to {home}: import it from there ({old} is an old path and "
                              "goes away in a later release)", DeprecationWarning, stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (its names moved to "
                             f"{', '.join(homes)})")

    return __getattr__
