"""Which implementation the engine's hot ops use on a device: "triton" kernels or the "torch" reference.

Rule (issue 11): CUDA and an importable triton -> "triton"; anything else -> "torch". An explicit choice
(an argument, else the ``LLMGW_ENGINE_BACKEND`` environment variable) overrides the rule, and a choice
that cannot work (triton on a CPU device without the interpreter, or triton not installed) stops start-up
with a BackendUnavailableError naming the reason, rather than silently running the other backend.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Literal

import torch

Backend = Literal["torch", "triton"]
BACKENDS: tuple[Backend, ...] = ("torch", "triton")
ENV_VAR = "LLMGW_ENGINE_BACKEND"
INTERPRET_ENV_VAR = "TRITON_INTERPRET"


class BackendUnavailableError(ValueError):
    """The requested backend cannot run here. ``backend`` is what was asked for, ``reason`` why not."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"engine backend {backend!r} is unavailable: {reason}")
        self.backend = backend
        self.reason = reason


def is_triton_importable() -> bool:
    """True when the ``triton`` package is installed (found without importing it: import takes ~2 s)."""
    return importlib.util.find_spec("triton") is not None


def select_backend(
    device: torch.device | str,
    override: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    triton_importable: bool | None = None,
) -> Backend:
    """The backend for ``device``.

    ``override`` ("torch" | "triton" | "auto" | None) wins; when it is None or "auto" the environment
    variable ``LLMGW_ENGINE_BACKEND`` (read from ``env``, default ``os.environ``) is consulted, and when that
    is unset, empty or "auto" the rule applies. ``triton_importable`` replaces the installed-package check
    (tests). Triton on a non-CUDA device is accepted only with ``TRITON_INTERPRET=1`` in ``env`` (the
    interpreter runs kernels on CPU tensors, slowly: tests only).
    """
    environ = os.environ if env is None else env
    device = torch.device(device)
    choice = override if override not in (None, "", "auto") else environ.get(ENV_VAR, "").strip().lower()
    has_triton = is_triton_importable() if triton_importable is None else triton_importable
    if choice in ("", "auto"):
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if choice not in BACKENDS:
        source = "argument" if override not in (None, "", "auto") else ENV_VAR
        raise BackendUnavailableError(str(choice), f"{source} must be one of torch, triton, auto")
    if choice == "torch":
        return "torch"
    if not has_triton:
        raise BackendUnavailableError("triton", "the triton package is not installed")
    if device.type != "cuda" and environ.get(INTERPRET_ENV_VAR, "") not in ("1", "true", "True"):
        raise BackendUnavailableError(
            "triton", f"device {device} is not CUDA (set {INTERPRET_ENV_VAR}=1 to interpret kernels on CPU)"
        )
    return "triton"
