"""Moved to :mod:`evenflow.exchange.orchestrator`:
this old path forwards every name there, with a ``DeprecationWarning``."""

from ...deprecation import moved

__getattr__ = moved(__name__, "evenflow.exchange.orchestrator")
