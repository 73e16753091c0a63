"""Moved to [`evenflow.step_info`][evenflow.step_info]: this old path forwards every name there, with a
``DeprecationWarning``."""

from ..deprecation import moved

__getattr__ = moved(__name__, "evenflow.step_info")
