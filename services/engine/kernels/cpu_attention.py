"""Compiled CPU kernels for the engine: decode attention over the paged cache, and RMSNorm.

A small C++ extension, compiled once per machine on first use. The torch reference decode attention
(``attention._decode_attention``) gathers every decode sequence's context out of the paged cache into one
padded tensor and runs SDPA over it: at 32 sequences the gather and SDPA were ~50 % of a tiny-model step
(docs/benchmarks.md). ``paged_decode`` reads each sequence's keys and values straight from their cache
slots, once, with no padding: per sequence, the scores of every query head, a softmax (max-subtracted,
exact within float rounding) and the weighted sum of values; sequences run in parallel on torch's
intra-op threads. ``rms_norm`` is transformers' RMSNorm in one pass (torch's CPU ``F.rms_norm`` is ~6
dispatches, ~8-14 us on a decode step's small rows; this is ~1 us). ``qk_norm_rope`` is an attention
layer's per-head q/k norms and RoPE in one call instead of ~10 dispatches.

They are used for float32 models (with a float32, ``auto``, KV cache for the attention) on the CPU when a
C++ compiler is at hand (g++, and ninja, a dependency, as ``torch.utils.cpp_extension`` needs); anything
else, or ``LLMGW_ENGINE_CPU_FUSED=0``, keeps the torch path. The build (~20 s on the 2-core bench
machine) happens when the engine loads its model, and is cached in torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a name that hashes the source, the
torch version and this CPU's instruction-set flags, so a cache shared between different CPUs never runs
code built for another.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "LLMGW_ENGINE_CPU_FUSED"

FusedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// q [B, Hq, D]; key/value cache [NB, BS, Hkv, D] (contiguous, float32); slots [B, Lmax] int64: the flat
// cache slot of each context position; lens [B] int64. Query head h reads KV head h / (Hq / Hkv).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor slots, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
              value_cache.scalar_type() == torch::kFloat32, "paged_decode: float32 tensors only");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64,
              "paged_decode: int64 slots and lens");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode: contiguous caches");
  auto qc = q.contiguous();
  auto sc = slots.contiguous();
  auto lc = lens.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), D = qc.size(2);
  const int64_t Hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && Hq % Hkv == 0, "paged_decode: head shapes do not match");
  const int64_t G = Hq / Hkv;
  const int64_t Lmax = sc.size(1);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  auto out = torch::empty({B, Hq, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = key_cache.data_ptr<float>();
  const float* vp = value_cache.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= Lmax, "paged_decode: a length outside 1..Lmax");
  }
  const float sm = static_cast<float>(scale);
  // One work item per sequence, all its heads: each context position's K (then V) row of Hkv x D floats
  // is read once, front to back through the cache, which the hardware prefetcher streams.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(Hq * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lp[b];
      const int64_t* row = sp + b * Lmax;
      scores.resize(Hq * L);
      const float* qb = qp + b * Hq * D;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t slot = row[l];
        TORCH_CHECK(slot >= 0 && slot < num_slots, "paged_decode: a slot outside the cache");
        const float* kr = kp + slot * Hkv * D;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* qh = qb + hq * D;
          const float* kh = kr + (hq / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[hq * L + l] = s * sm;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* sh = scores.data() + hq * L;
        float m = sh[0];
        for (int64_t l = 1; l < L; ++l) m = std::max(m, sh[l]);
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          sh[l] = std::exp(sh[l] - m);
          sum += sh[l];
        }
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < L; ++l) sh[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const float* vr = vp + row[l] * Hkv * D;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float p = scores[hq * L + l];
          const float* vh = vr + (hq / G) * D;
          float* ah = acc.data() + hq * D;
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * Hq * D);
    }
  });
  return out;
}

// weight * (x / rms(x)) over the last dim of a float32 x (any leading shape), transformers' order: the
// mean of squares, plus eps, its reciprocal square root (in double, then rounded: no approximate rsqrt).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "rms_norm: float32 tensors only");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t H = xc.size(-1);
  TORCH_CHECK(wc.numel() == H, "rms_norm: weight size does not match the last dim");
  const int64_t N = H ? xc.numel() / H : 0;
  auto out = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fe = static_cast<float>(eps);
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * H;
      float* orow = op + r * H;
      float ss = 0.f;
      for (int64_t d = 0; d < H; ++d) ss += xr[d] * xr[d];
      const float var = ss / static_cast<float>(H) + fe;
      const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var)));
      for (int64_t d = 0; d < H; ++d) orow[d] = wp[d] * (xr[d] * inv);
    }
  });
  return out;
}

// q [T, Hq, D] and k [T, Hk, D] (any strides in T and H, D contiguous): optional per-head RMSNorm (qw/kw
// [D], or empty tensors for none), then neox RoPE, x * cos + roll(x, D/2) * signed_sin, with cos and
// signed_sin [T, 1, D] (model.rope_tables). Products and sums rounded one by one (-ffp-contract=off), as
// torch's separate mul and add round them. Returns new contiguous q and k.
static void norm_rope_rows(const float* xp, int64_t st, int64_t sh, int64_t T, int64_t H, int64_t D,
                           const float* w, float eps, const float* cp, const float* sp, float* op) {
  at::parallel_for(0, T * H, std::max<int64_t>(1, 4096 / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / H, h = r % H;
      const float* xr = xp + t * st + h * sh;
      if (w != nullptr) {
        float ss = 0.f;
        for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];
        const float var = ss / static_cast<float>(D) + eps;
        const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var)));
        for (int64_t d = 0; d < D; ++d) row[d] = w[d] * (xr[d] * inv);
      } else {
        for (int64_t d = 0; d < D; ++d) row[d] = xr[d];
      }
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      float* o = op + r * D;
      const int64_t half = D / 2;
      for (int64_t d = 0; d < D; ++d) {
        const float rolled = row[d < half ? d + half : d - half];
        const float a = row[d] * c[d];
        const float b = rolled * s[d];
        o[d] = a + b;
      }
    }
  });
}

std::vector<torch::Tensor> qk_norm_rope(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                        torch::Tensor signed_sin, torch::Tensor qw, torch::Tensor kw, double eps) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              cos.scalar_type() == torch::kFloat32 && signed_sin.scalar_type() == torch::kFloat32,
              "qk_norm_rope: float32 tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "qk_norm_rope: [T, H, D]");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "qk_norm_rope: q and k shapes do not match");
  auto cc = cos.contiguous();
  auto sc = signed_sin.contiguous();
  TORCH_CHECK(cc.numel() == T * D && sc.numel() == T * D, "qk_norm_rope: cos/sin must be [T, 1, D]");
  const bool norm = qw.numel() > 0;
  auto qwc = qw.contiguous();
  auto kwc = kw.contiguous();
  if (norm) {
    TORCH_CHECK(qwc.numel() == D && kwc.numel() == D && qwc.scalar_type() == torch::kFloat32 &&
                kwc.scalar_type() == torch::kFloat32, "qk_norm_rope: norm weights must be [D] float32");
  }
  auto qo = torch::empty({T, q.size(1), D}, q.options());
  auto ko = torch::empty({T, k.size(1), D}, k.options());
  const float fe = static_cast<float>(eps);
  norm_rope_rows(q.data_ptr<float>(), q.stride(0), q.stride(1), T, q.size(1), D,
                 norm ? qwc.data_ptr<float>() : nullptr, fe, cc.data_ptr<float>(), sc.data_ptr<float>(),
                 qo.data_ptr<float>());
  norm_rope_rows(k.data_ptr<float>(), k.stride(0), k.stride(1), T, k.size(1), D,
                 norm ? kwc.data_ptr<float>() : nullptr, fe, cc.data_ptr<float>(), sc.data_ptr<float>(),
                 ko.data_ptr<float>());
  return {qo, ko};
}
"""

# -ffast-math lets the compiler vectorise the dot products, sums and exp (glibc's vector exp); inputs are
# finite and every exponent is <= 0 (max-subtracted), so none of its assumptions is violated.
# -ffp-contract=off keeps products and sums rounded one by one (no fused multiply-add), as torch's separate
# elementwise ops round them: RoPE is then bit-identical to the torch ops.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-ffp-contract=off", "-fopenmp"]

# The compiled kernels once loaded (None before, or when they cannot be built). ``paged_decode`` is handed
# to the model's TorchPagedAttention; ``rms_norm`` (model.rms_norm: float32 on the CPU, one pass instead of
# torch's ~6 dispatches) and ``qk_norm_rope`` (model.Attention.forward) are read here at each call.
paged_decode: FusedDecode | None = None
rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
qk_norm_rope: Callable[..., list[torch.Tensor]] | None = None

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


def _extension_name() -> str:
    digest = hashlib.sha256("\0".join([_SOURCE, " ".join(_CFLAGS), torch.__version__, _cpu_flags()]).encode())
    return f"ninfer_cpu_decode_{digest.hexdigest()[:12]}"


def _is_built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: only for the log line

        return any(Path(_get_build_directory(name, verbose=False)).glob("*.so"))
    except Exception:
        return True


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) puts it in the venv's
    bin, which is not on PATH when the venv's python is run without activating it."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def fused_decode() -> FusedDecode | None:
    """The compiled kernel, built on the first call (None when disabled or it cannot be built; the reason
    is logged once, with what to do)."""
    global _loaded, paged_decode, rms_norm, qk_norm_rope
    with _lock:
        if _loaded:
            return paged_decode
        _loaded = True
        if os.environ.get(ENV_VAR, "1").strip() == "0":
            log.info("fused CPU decode attention off (%s=0): using the torch path", ENV_VAR)
            return None
        name = _extension_name()
        if not _is_built(name):
            log.info("compiling the engine's CPU kernels (decode attention, RMSNorm), once per machine: ~20 s")
        _put_ninja_on_path()
        try:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(name, cpp_sources=[_SOURCE], functions=["paged_decode", "rms_norm", "qk_norm_rope"],
                                 extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            log.warning("fused CPU decode attention unavailable (%s); using the slower torch path. Install a "
                        "C++ compiler (apt-get install g++) to enable it, or set %s=0 to silence this",
                        reason, ENV_VAR)
            return None
        paged_decode, rms_norm, qk_norm_rope = module.paged_decode, module.rms_norm, module.qk_norm_rope
        return paged_decode
