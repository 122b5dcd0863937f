"""Test-time speed-up of Triton's CPU interpreter (TRITON_INTERPRET=1), which runs every kernel of the suite.

The interpreter swaps ``triton.language``'s builtins for numpy versions when a kernel launches (``_patch_lang``,
undone when the grid is done), and again at every call of a ``@triton.jit`` helper from inside the kernel: each
program of the grid, each trip of its K loop, for every ``tile_mm``-style helper. The repeat finds the same
modules already patched and sets the same values, but walks them with ``inspect.getmembers`` each time: half of
the time of a layer test in the interpreter (1.9 of 3.5 s for test_fused_permute's top-4 case, Triton 3.9).

``install()`` keeps the launch's patch and skips the repeats inside it whose language modules were patched since
the launch began (the first helper that sees a module the kernel does not, such as Triton's own ``tl.sum``, which
sees ``triton.language.core``, still patches it). Kernels compute exactly what they did:
the repeats changed nothing. Where Triton's interpreter lacks the names this wraps (another version), nothing is
installed and the interpreter runs as shipped.
"""
from __future__ import annotations

import inspect
import os
import threading

_INSTALLED = False


def install() -> bool:
    """Install the skip once per process (no-op without TRITON_INTERPRET=1 or on an unknown interpreter);
    returns whether it is active."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return False
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # noqa: BLE001 - no Triton: nothing to speed up
        return False
    names = ("_patch_lang", "_LangPatchScope", "GridExecutor", "tl")
    if not all(hasattr(interp, n) for n in names) or not callable(getattr(interp.GridExecutor, "__call__", None)):
        return False
    langs = (interp.tl, interp.tl.core)
    real_patch = interp._patch_lang
    real_launch = interp.GridExecutor.__call__
    local = threading.local()  # .launches: per running launch of this thread, the modules patched since it began

    seen_in: dict = {}  # (id, size) of a module's globals -> the language modules they hold

    def visible(fn) -> frozenset:
        key = (id(fn.__globals__), len(fn.__globals__))  # the interpreter adds names to a module's globals
        if key not in seen_in:
            seen_in[key] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and any(v is m for m in langs))
        return seen_in[key]

    def patch_lang(fn):
        launches = getattr(local, "launches", None)
        if launches:
            seen = visible(fn)
            if seen <= launches[-1]:  # a helper called inside the launch: these modules are patched already
                return interp._LangPatchScope()
            launches[-1] |= seen
        return real_patch(fn)

    def launch(self, *args, **kwargs):
        launches = local.__dict__.setdefault("launches", [])
        launches.append(set())
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = launch
    _INSTALLED = True
    return True
