"""Moved to :mod:`evenflow.vlm.qwen_omni`: this old path forwards every name there, with a ``DeprecationWarning``."""

from ...deprecation import moved

__getattr__ = moved(__name__, "evenflow.vlm.qwen_omni")
