"""Import Triton kernel modules under the interpreter (``TRITON_INTERPRET=1``) for the CPU kernel tests.

triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when a kernel module is first
imported: :func:`import_interpreted` sets it, imports (or reloads, when something imported them earlier without
it) the named modules, then restores the environment so the rest of the session does not inherit it; the
tests' own fixtures set it again around each test.

triton's own library functions (``tl.sum``, ``tl.max`` …) are ``@triton.jit`` functions too, decorated when
triton is imported: a triton imported earlier without the variable cannot be interpreted, and reloading it
is not safe, so that case stops with the reason instead of failing every test. Without triton installed
(pyproject installs it on Linux x86_64 only) the calling test module is skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest


def import_interpreted(*names: str) -> list[ModuleType]:
    """The modules ``names``, imported (or reloaded) with TRITON_INTERPRET=1."""
    if "triton" in sys.modules:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(sys.modules["triton"].language.standard.sum, InterpretedFunction):
            raise RuntimeError("triton was imported before this test module without TRITON_INTERPRET=1; run the "
                               "Triton tests in their own process (or set TRITON_INTERPRET=1)")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton", reason="triton is not installed (pyproject installs it on Linux x86_64 only)")
        return [importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
                for name in names]
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
