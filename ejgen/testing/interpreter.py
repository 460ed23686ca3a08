"""Triton's interpreter without its per-call re-patching (tests and CPU runs only; the kernels are unchanged).

A launch in Triton's interpreter (``GridExecutor.__call__``) swaps ``triton.language``'s builtins for interpreted
ones, runs the grid, and restores them. Every call of a nested ``@triton.jit`` helper
(``InterpretedFunction.__call__``) patches the language again (Triton 3.9), although the launch's patch is still in
place: a scan of every module member (``inspect.getmembers``) that finds nothing left to patch, and fresh copies of
the same tensor methods. With the kernels' per-tile helpers (masks, visibility, tile loops) that is about a quarter
of an interpreted kernel's run time. ``skip_nested_patches`` keeps a helper's call from patching again when every
language module the helper sees was already patched during the running launch (by the launch, or by a helper call
before it: nothing undoes a patch before the launch ends), and leaves every other call as Triton makes it.
"""

from __future__ import annotations

import inspect


_LANGUAGES: dict = {}  # function -> ids of the language modules its globals hold (what `_patch_lang` patches)


def _languages(fn) -> frozenset:
    if fn not in _LANGUAGES:
        import triton.language as tl

        _LANGUAGES[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    return _LANGUAGES[fn]


def skip_nested_patches() -> bool:
    """Install the shortcut (once per process); False where this Triton's interpreter is not the one it knows."""
    from triton.runtime import interpreter

    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    nested_call = getattr(getattr(interpreter, "InterpretedFunction", None), "__call__", None)
    if grid_call is None or nested_call is None or getattr(grid_call, "_ejgen", False):
        return grid_call is not None and getattr(grid_call, "_ejgen", False)
    src = inspect.getsource(nested_call)
    if "_patch_lang(self.fn)" not in src or "self.rewrite()" not in src:
        return False
    patched = []  # the language modules patched while the running launch runs (launches nest no deeper than one)

    def launch(self, *args, **kwargs):
        patched.append(set(_languages(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        if not patched:
            return nested_call(self, *args, **kwargs)
        languages = _languages(self.fn)
        if not languages <= patched[-1]:  # e.g. Triton's own helpers (tl.core): patched as Triton does, and kept
            patched[-1] |= languages  # so until the launch ends (Triton restores only the launch's own patch)
            return nested_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    launch._ejgen = True
    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call
    return True
