"""Moved to :mod:`evenflow.testing.mllm_step`:
this old path forwards every name there, with a ``DeprecationWarning``."""

from ..deprecation import moved

__getattr__ = moved(__name__, "evenflow.testing.mllm_step")
