"""Moved to :mod:`evenflow.balance.phases.meta`:
this old path forwards every name there, with a ``DeprecationWarning``."""

from ...deprecation import moved

__getattr__ = moved(__name__, "evenflow.balance.phases.meta")
