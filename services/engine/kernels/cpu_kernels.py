"""Compiled CPU kernels for the engine (C++ in ``cpu_kernels.cpp``): a whole decoder forward, and single ops.

A small C++ extension, compiled once per machine on first use.

* ``Decoder``: one step of the decoder (embedding, every layer, the final norm) over the paged KV cache in
  one call. A tiny model's step in the torch path is ~40 Python-level op calls per layer, each a few
  microseconds of interpreter and dispatcher time around microseconds of work; here the products are the
  same oneDNN / MKL calls ``model.linear`` makes (through the dispatcher, from C++), and the norms, RoPE,
  the cache write, SwiGLU (torch's formula) and attention are the kernels in the same file. Attention:
  every token of the step (a decode or a prompt-chunk row alike) reads its causal context straight from
  its sequence's cache slots, with no gather and no padding, the work cut evenly across threads.
* ``paged_decode``: the decode attention alone, for the torch path (``TorchPagedAttention``).
* ``rms_norm`` and ``qk_norm_rope``: transformers' RMSNorm in one pass (torch's CPU ``F.rms_norm`` is ~6
  dispatches, ~8-14 us on a decode step's small rows; this is ~1 us), and an attention layer's per-head
  q/k norms and RoPE in one call instead of ~10.
* ``argmax_rows``: the sampler's greedy argmax (torch 2.13's CPU argmax is ~4x slower on a step's logits).

They are used for float32 models (with a float32, ``auto``, KV cache) on the CPU when a C++ compiler is at
hand (g++, and ninja, a dependency, as ``torch.utils.cpp_extension`` needs); anything else, or
``LLMGW_ENGINE_CPU_FUSED=0``, keeps the torch path. The build (~30 s on the 2-core bench machine) happens
when the engine loads its model, and is cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) under a name that hashes the source, the torch version and this
CPU's instruction-set flags, so a cache shared between different CPUs never runs code built for another.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV_VAR = "LLMGW_ENGINE_CPU_FUSED"

FusedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

_SOURCE = (Path(__file__).parent / "cpu_kernels.cpp").read_text()

# -ffast-math lets the compiler vectorise the dot products, sums and exp (glibc's vector exp); inputs are
# finite and every exponent is <= 0 (max-subtracted), so none of its assumptions is violated.
# -ffp-contract=off keeps products and sums rounded one by one (no fused multiply-add), as torch's separate
# elementwise ops round them: RoPE is then bit-identical to the torch ops.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-ffp-contract=off", "-fopenmp"]

# The compiled kernels once loaded (None before, or when they cannot be built). ``paged_decode`` is handed
# to the model's TorchPagedAttention; ``rms_norm`` (model.rms_norm: float32 on the CPU, one pass instead of
# torch's ~6 dispatches), ``qk_norm_rope`` (model.Attention.forward) and ``Decoder`` (model.CausalLM) are
# read here at each use.
paged_decode: FusedDecode | None = None
rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
qk_norm_rope: Callable[..., list[torch.Tensor]] | None = None
Decoder: Callable[..., Any] | None = None
argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

_lock = threading.Lock()
_loaded = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str:
    """The C++ compiler torch's builder will run (``$CXX``, else ``c++``) and its version line: a compiler
    upgrade builds afresh instead of loading objects another compiler made."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    return f"{cxx} {out.splitlines()[0] if out else ''}"


def _extension_name() -> str:
    # sys.prefix: one build folder per environment. torch writes the venv's include paths into the folder's
    # build.ninja, so two venvs sharing one folder (a checkout and its fresh clone, an upgrade beside the old
    # install) rebuild it in turn on every engine start, each build a minute or more on a busy machine.
    # torch's version and the compiler's: either changing means a new build, in a folder of its own.
    digest = hashlib.sha256("\0".join([_SOURCE, " ".join(_CFLAGS), torch.__version__, _cpu_flags(),
                                       sys.prefix, _compiler()]).encode())
    return f"ninfer_cpu_kernels_{digest.hexdigest()[:12]}"


def _is_built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: only for the log line

        return any(Path(_get_build_directory(name, verbose=False)).glob("*.so"))
    except Exception:
        return True


@contextlib.contextmanager
def _sole_builder(name: str) -> Iterator[None]:
    """Hold an OS lock on the extension's build folder while torch builds or loads it.

    torch's builder marks a build with a ``lock`` file and every later build of that name waits for the file
    to go, forever: a builder killed mid-build (a crash, a test's SIGKILL, Ctrl-C in ``llmgw up``) leaves it
    behind and every later engine start hangs. ``flock`` is released by the kernel when its holder dies, so
    whoever holds it is the only live builder here and a ``lock`` file found then is stale: remove it.
    """
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: the folder torch builds in

        folder = Path(_get_build_directory(name, verbose=False))
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ".ninfer-build.flock", "a+")
    except Exception:  # no folder we can lock: build as torch would alone
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another engine is building the CPU kernels in %s: waiting for it", folder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("removed a stale build lock left by a killed engine (%s)", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) puts it in the venv's
    bin, which is not on PATH when the venv's python is run without activating it."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def fused_decode() -> FusedDecode | None:
    """The compiled kernel, built on the first call (None when disabled or it cannot be built; the reason
    is logged once, with what to do)."""
    global _loaded, paged_decode, rms_norm, qk_norm_rope, Decoder, argmax_rows
    with _lock:
        if _loaded:
            return paged_decode
        _loaded = True
        if os.environ.get(ENV_VAR, "1").strip() == "0":
            log.info("fused CPU decode attention off (%s=0): using the torch path", ENV_VAR)
            return None
        name = _extension_name()
        if not _is_built(name):
            log.info("compiling the engine's CPU kernels (decoder, attention, norms), once per environment, torch "
                     "version and compiler: ~30 s")
        _put_ninja_on_path()
        try:
            from torch.utils.cpp_extension import load_inline

            with _sole_builder(name):
                module = load_inline(name, cpp_sources=[_SOURCE], extra_cflags=_CFLAGS,
                                     extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            log.warning("fused CPU decode attention unavailable (%s); using the slower torch path. Install a "
                        "C++ compiler (apt-get install g++) to enable it, or set %s=0 to silence this",
                        reason, ENV_VAR)
            return None
        paged_decode, rms_norm, qk_norm_rope = module.paged_decode, module.rms_norm, module.qk_norm_rope
        Decoder, argmax_rows = module.Decoder, module.argmax_rows
        return paged_decode
