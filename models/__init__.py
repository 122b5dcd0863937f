"""Switch-, Mixtral- and DeepSeek-style decoder models (single-device code).

The public names (docs/architecture.md, "Model"): ``ModelConfig``, ``PRESETS``, ``preset`` (moekit.models.config),
``Transformer``, ``KVCache``, ``build_model`` (moekit.models.transformer). They load on first use, so importing
``moekit.models.config`` (the programs' flag checks) does not import torch.
"""
from __future__ import annotations

_EXPORTS = {"ModelConfig": "config", "PRESETS": "config", "preset": "config",
            "Transformer": "transformer", "KVCache": "transformer", "build_model": "transformer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"moekit.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
