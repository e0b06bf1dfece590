// The engine's compiled CPU kernels (loaded by cpu_kernels.py): float32 only.
//
// * paged_decode, rms_norm, qk_norm_rope: single ops the torch model path calls (model.py, attention.py);
//   argmax_rows: the sampler's greedy argmax.
// * Decoder: a whole decoder forward (embedding .. final norm, and the LM head on the sampled rows) over
//   the paged KV cache in one call, so a step of a small model no longer pays Python and dispatcher costs
//   per op (~40 ops per layer in the torch path). It computes what model.CausalLM.forward computes, op
//   for op: the same oneDNN / MKL products (called through the dispatcher, the same kernels the Python
//   path picks), and the kernels below for the norms, RoPE, the cache write, SwiGLU and attention.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

// ------------------------------------------------------------------------------------------ attention
//
// Every query token attends over its own causal context: positions 0 .. L-1 of its sequence, whose flat
// cache slots are `slots[0..L)` (a decode token and a prompt-chunk row are the same case). Work is the
// concatenation of all tokens' positions, cut into one equal part per thread: a token that straddles a
// cut is computed in pieces (each a max, a sum of exponentials and unnormalised weighted values per head)
// that are merged afterwards, as flash-decoding does. So one long context at concurrency 1 uses every
// core, and a step of uneven contexts keeps them equally busy.
//
// Dot products and weighted sums run on 8-float vectors (GCC vector extensions: AVX2 or AVX-512VL), with
// fused multiply-adds (fp-contract=fast here only: RoPE elsewhere needs torch's separate roundings). The
// scores of 8 positions are reduced together (reduce8x8), not one horizontal sum each.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof v); }

inline float sum8(v8f v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// out[j] = the sum of x[j]'s 8 lanes: a transpose-and-add tree (3 levels of 4/2/1 vector pairs), then
// one shuffle back to natural order (the tree leaves lane j holding x[bitreverse(j)]).
inline v8f reduce8x8(const v8f* x) {
  const v8i lo1 = {0, 1, 2, 3, 8, 9, 10, 11}, hi1 = {4, 5, 6, 7, 12, 13, 14, 15};
  const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const v8i lo3 = {0, 8, 2, 10, 4, 12, 6, 14}, hi3 = {1, 9, 3, 11, 5, 13, 7, 15};
  const v8i order = {0, 4, 2, 6, 1, 5, 3, 7};
  v8f y[4];
  for (int i = 0; i < 4; ++i) {
    y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo1) + __builtin_shuffle(x[2 * i], x[2 * i + 1], hi1);
  }
  const v8f z0 = __builtin_shuffle(y[0], y[1], lo2) + __builtin_shuffle(y[0], y[1], hi2);
  const v8f z1 = __builtin_shuffle(y[2], y[3], lo2) + __builtin_shuffle(y[2], y[3], hi2);
  const v8f w = __builtin_shuffle(z0, z1, lo3) + __builtin_shuffle(z0, z1, hi3);
  return __builtin_shuffle(w, order);
}

// Pull the cache rows of `count` context positions into the cache ahead of use: contexts are scattered
// over blocks, which the hardware prefetcher does not follow (a cold 32 x 300-token layer ran at ~20 GB/s
// of the machine's ~70).
inline void prefetch_rows(const float* base, const int64_t* sl, int64_t count, int64_t row) {
  const int64_t bytes = row * static_cast<int64_t>(sizeof(float));
  for (int64_t u = 0; u < count; ++u) {
    const char* r = reinterpret_cast<const char*>(base + sl[u] * row);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(r + b, 0, 1);
  }
}

// One head's n scores in place -> exp(score - max): *m the max, *s the sum of the exponentials.
inline void exp_scores(float* sh, int64_t n, float* m, float* s) {
  float mx = sh[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sh[i]);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    sh[i] = std::exp(sh[i] - mx);
    sum += sh[i];
  }
  *m = mx;
  *s = sum;
}

// Scores of positions sl[0..8) for NH query heads q[0..NH) (D floats each) against their KV head's keys
// (at `off` in each row): 8 dot products per head, reduced together, scaled, stored to scores[g * n].
// The widest vector the target has: 16 floats with AVX-512, else 8. Dot products and weighted sums run on
// it; scores are folded to 8 lanes for reduce8x8.
#if defined(__AVX512F__)
typedef float vwf __attribute__((vector_size(64)));
constexpr int kWide = 16;
inline v8f fold8(vwf v) {
  v8f lo, hi;
  __builtin_memcpy(&lo, &v, sizeof lo);
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lo + hi;
}
#else
typedef v8f vwf;
constexpr int kWide = 8;
inline v8f fold8(vwf v) { return v; }
#endif

// Scores of positions sl[0..8) for NH query heads q[0..NH) (D floats each) against their KV head's keys
// (at `off` in each row): 8 dot products per head, reduced together, scaled, stored to scores[g * n].
template <int D, int NH>
inline void score8(const float* q, const int64_t* sl, const float* kp, int64_t row, int64_t off, float scale,
                   float* scores, int64_t n) {
  constexpr int W = D % kWide == 0 ? kWide : 8;
  typedef float vec __attribute__((vector_size(W * 4)));
  constexpr int C = D / W;
  vec x[NH][8];
  for (int u = 0; u < 8; ++u) {
    const float* kr = kp + sl[u] * row + off;
    vec k0;
    __builtin_memcpy(&k0, kr, sizeof k0);
    for (int g = 0; g < NH; ++g) {
      vec q0;
      __builtin_memcpy(&q0, q + g * D, sizeof q0);
      x[g][u] = q0 * k0;
    }
#pragma GCC unroll 32
    for (int c = 1; c < C; ++c) {
      vec kc;
      __builtin_memcpy(&kc, kr + W * c, sizeof kc);
      for (int g = 0; g < NH; ++g) {
        vec qc;
        __builtin_memcpy(&qc, q + g * D + W * c, sizeof qc);
        x[g][u] += qc * kc;
      }
    }
  }
  for (int g = 0; g < NH; ++g) {
    v8f f[8];
    for (int u = 0; u < 8; ++u) {
      if constexpr (W == 8) {
        __builtin_memcpy(&f[u], &x[g][u], sizeof f[u]);
      } else {
        vwf w;
        __builtin_memcpy(&w, &x[g][u], sizeof w);
        f[u] = fold8(w);
      }
    }
    store8(scores + g * n, reduce8x8(f) * scale);
  }
}

// acc[g] += sum over positions sl[0..count) of p[g * n + i] * value row i, for NH heads sharing a KV head.
template <int D, int NH>
inline void weigh(const float* p, const int64_t* sl, int64_t count, const float* vp, int64_t row, int64_t off,
                  float* acc, int64_t n) {
  constexpr int W = D % kWide == 0 ? kWide : 8;
  typedef float vec __attribute__((vector_size(W * 4)));
  constexpr int C = D / W;
  vec a[NH][C];
  for (int g = 0; g < NH; ++g) {
    for (int c = 0; c < C; ++c) __builtin_memcpy(&a[g][c], acc + g * D + W * c, sizeof(vec));
  }
  for (int64_t i = 0; i < count; ++i) {
    const float* vr = vp + sl[i] * row + off;
#pragma GCC unroll 32
    for (int c = 0; c < C; ++c) {
      vec vc;
      __builtin_memcpy(&vc, vr + W * c, sizeof vc);
      for (int g = 0; g < NH; ++g) a[g][c] += (vec{} + p[g * n + i]) * vc;
    }
  }
  for (int g = 0; g < NH; ++g) {
    for (int c = 0; c < C; ++c) __builtin_memcpy(acc + g * D + W * c, &a[g][c], sizeof(vec));
  }
}

// Positions [l0, l1) of one token, every head (D % 8 == 0): per head h, m[h] the max score, s[h] the sum
// of exp(score - m[h]), acc[h] the sum of exp(score - m[h]) * value. `scores`: Hq * (l1 - l0) floats.
// Positions are taken a tile at a time (8 for scores, 16 for values), every head over the tile before the
// next: each tile's rows are read from memory once, whole, and then served from L1 to every head.
// Heads are taken in pairs where a KV head serves an even number of them (one key or value load feeds
// two heads), else one at a time.
template <int D>
void attend_piece(const float* q, const int64_t* slots, int64_t l0, int64_t l1, const float* kp, const float* vp,
                  int64_t Hq, int64_t Hkv, float scale, float* scores, float* m, float* s, float* acc) {
  const int64_t n = l1 - l0, G = Hq / Hkv, row = Hkv * D;
  const bool pairs = G % 2 == 0;
  const int64_t* sl = slots + l0;
  constexpr int64_t ahead = 16;  // positions prefetched ahead of the tile in use
  prefetch_rows(kp, sl, std::min(n, ahead), row);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    if (j + ahead < n) prefetch_rows(kp, sl + j + ahead, std::min<int64_t>(8, n - j - ahead), row);
    for (int64_t h = 0; h < Hq; h += pairs ? 2 : 1) {
      const int64_t off = (h / G) * D;
      if (pairs) {
        score8<D, 2>(q + h * D, sl + j, kp, row, off, scale, scores + h * n + j, n);
      } else {
        score8<D, 1>(q + h * D, sl + j, kp, row, off, scale, scores + h * n + j, n);
      }
    }
  }
  for (; j < n; ++j) {
    for (int64_t h = 0; h < Hq; ++h) {
      const float* kr = kp + sl[j] * row + (h / G) * D;
      v8f a = load8(q + h * D) * load8(kr);
      for (int c = 1; c < D / 8; ++c) a += load8(q + h * D + 8 * c) * load8(kr + 8 * c);
      scores[h * n + j] = sum8(a) * scale;
    }
  }
  prefetch_rows(vp, sl, std::min(n, ahead), row);
  for (int64_t h = 0; h < Hq; ++h) exp_scores(scores + h * n, n, m + h, s + h);
  std::fill(acc, acc + Hq * D, 0.f);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    if (i + ahead < n) prefetch_rows(vp, sl + i + ahead, std::min<int64_t>(16, n - i - ahead), row);
    for (int64_t h = 0; h < Hq; h += pairs ? 2 : 1) {
      const int64_t off = (h / G) * D;
      if (pairs) {
        weigh<D, 2>(scores + h * n + i, sl + i, count, vp, row, off, acc + h * D, n);
      } else {
        weigh<D, 1>(scores + h * n + i, sl + i, count, vp, row, off, acc + h * D, n);
      }
    }
  }
}

// The same for any head size, one position and head at a time.
void attend_piece_any(const float* q, const int64_t* slots, int64_t l0, int64_t l1, const float* kp,
                      const float* vp, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* scores, float* m,
                      float* s, float* acc) {
  const int64_t n = l1 - l0, G = Hq / Hkv, row = Hkv * D;
  for (int64_t h = 0; h < Hq; ++h) {
    const float* qh = q + h * D;
    const int64_t off = (h / G) * D;
    float* sh = scores + h * n;
    for (int64_t i = 0; i < n; ++i) {
      const float* kr = kp + slots[l0 + i] * row + off;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * kr[d];
      sh[i] = dot * scale;
    }
    exp_scores(sh, n, m + h, s + h);
    float* ah = acc + h * D;
    std::fill(ah, ah + D, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const float* vr = vp + slots[l0 + i] * row + off;
      const float p = sh[i];
      for (int64_t d = 0; d < D; ++d) ah[d] += p * vr[d];
    }
  }
}

void attend_piece_dispatch(const float* q, const int64_t* slots, int64_t l0, int64_t l1, const float* kp,
                           const float* vp, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* scores,
                           float* m, float* s, float* acc) {
  switch (D) {
    case 32: return attend_piece<32>(q, slots, l0, l1, kp, vp, Hq, Hkv, scale, scores, m, s, acc);
    case 64: return attend_piece<64>(q, slots, l0, l1, kp, vp, Hq, Hkv, scale, scores, m, s, acc);
    case 128: return attend_piece<128>(q, slots, l0, l1, kp, vp, Hq, Hkv, scale, scores, m, s, acc);
    case 256: return attend_piece<256>(q, slots, l0, l1, kp, vp, Hq, Hkv, scale, scores, m, s, acc);
    case 16: return attend_piece<16>(q, slots, l0, l1, kp, vp, Hq, Hkv, scale, scores, m, s, acc);
    case 8: return attend_piece<8>(q, slots, l0, l1, kp, vp, Hq, Hkv, scale, scores, m, s, acc);
    default: return attend_piece_any(q, slots, l0, l1, kp, vp, Hq, Hkv, D, scale, scores, m, s, acc);
  }
}

#pragma GCC pop_options

// Attention of T query tokens (q [T, Hq, D] contiguous) over their contexts: token t reads lens[t] cache
// slots from token_slots[t]. Writes out [T, Hq, D].
void attend(const float* qp, const int64_t* const* token_slots, const int64_t* lens, int64_t T, const float* kp,
            const float* vp, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* op) {
  int64_t total = 0;
  for (int64_t t = 0; t < T; ++t) total += lens[t];
  // One part per thread, none under ~16k multiply-adds (a thread hand-off costs about that).
  const int64_t work = total * Hq * D * 2;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work / 16384));
  // Part p covers positions [p * total / parts, (p + 1) * total / parts) of the concatenation.
  std::vector<int64_t> first(T + 1, 0);  // first[t]: where token t starts in the concatenation
  for (int64_t t = 0; t < T; ++t) first[t + 1] = first[t] + lens[t];
  // Pieces of tokens cut by a part boundary: (token, m, s, acc) per piece, merged after.
  struct Piece {
    int64_t token;
    std::vector<float> m, s, acc;
  };
  std::vector<std::vector<Piece>> cut(parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, m(Hq), s(Hq), acc(Hq * D);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t lo = p * total / parts, hi = (p + 1) * total / parts;
      int64_t t = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
      for (; t < T && first[t] < hi; ++t) {
        const int64_t l0 = std::max(lo, first[t]) - first[t];
        const int64_t l1 = std::min(hi, first[t + 1]) - first[t];
        if (l1 <= l0) continue;
        scores.resize(Hq * (l1 - l0));
        attend_piece_dispatch(qp + t * Hq * D, token_slots[t], l0, l1, kp, vp, Hq, Hkv, D, scale, scores.data(),
                              m.data(), s.data(), acc.data());
        if (l0 == 0 && l1 == lens[t]) {
          float* o = op + t * Hq * D;
          for (int64_t h = 0; h < Hq; ++h) {
            const float inv = 1.f / s[h];
            for (int64_t d = 0; d < D; ++d) o[h * D + d] = acc[h * D + d] * inv;
          }
        } else {
          cut[p].push_back(Piece{t, m, s, acc});
        }
      }
    }
  });
  // Merge the pieces of each cut token (in part order): rescale each to the common max.
  std::vector<const Piece*> pieces;
  for (const auto& part : cut) {
    for (const auto& piece : part) pieces.push_back(&piece);
  }
  for (size_t i = 0; i < pieces.size();) {
    size_t j = i;
    while (j < pieces.size() && pieces[j]->token == pieces[i]->token) ++j;
    float* o = op + pieces[i]->token * Hq * D;
    for (int64_t h = 0; h < Hq; ++h) {
      float mx = pieces[i]->m[h];
      for (size_t k = i + 1; k < j; ++k) mx = std::max(mx, pieces[k]->m[h]);
      float sum = 0.f;
      std::vector<float> out(D, 0.f);
      for (size_t k = i; k < j; ++k) {
        const float w = std::exp(pieces[k]->m[h] - mx);
        sum += pieces[k]->s[h] * w;
        for (int64_t d = 0; d < D; ++d) out[d] += pieces[k]->acc[h * D + d] * w;
      }
      for (int64_t d = 0; d < D; ++d) o[h * D + d] = out[d] / sum;
    }
    i = j;
  }
}

// ------------------------------------------------------------------------------------- norms and RoPE

// weight * (x / rms(x)) per row, transformers' order: the mean of squares, plus eps, its reciprocal
// square root (in double, then rounded: no approximate rsqrt), times x, times the weight.
inline void rms_norm_row(const float* xr, const float* wp, float eps, int64_t H, float* orow) {
  float ss = 0.f;
  for (int64_t d = 0; d < H; ++d) ss += xr[d] * xr[d];
  const float var = ss / static_cast<float>(H) + eps;
  const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var)));
  for (int64_t d = 0; d < H; ++d) orow[d] = wp[d] * (xr[d] * inv);
}

// Rows of q or k [T, H, D] (strides st, sh; D contiguous): optional per-head RMSNorm (w [D] or null), then
// neox RoPE, x * cos + roll(x, D/2) * signed_sin, with cos and signed_sin rows of D floats (model.rope_tables):
// row t of the tables for token t, or row pos[t] when a position index is given.
// Products and sums rounded one by one (-ffp-contract=off), as torch's separate mul and add round them.
void norm_rope_rows(const float* xp, int64_t st, int64_t sh, int64_t T, int64_t H, int64_t D,
                    const float* w, float eps, const float* cp, const float* sp, float* op,
                    const int64_t* pos = nullptr) {
  at::parallel_for(0, T * H, std::max<int64_t>(1, 4096 / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / H, h = r % H;
      const float* xr = xp + t * st + h * sh;
      if (w != nullptr) {
        rms_norm_row(xr, w, eps, D, row.data());
      } else {
        std::copy(xr, xr + D, row.data());
      }
      const int64_t at_row = pos == nullptr ? t : pos[t];
      const float* c = cp + at_row * D;
      const float* s = sp + at_row * D;
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

int64_t norm_grain(int64_t H) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)); }

// N rows of H floats, in parallel.
void rms_norm_rows(const float* xp, const float* wp, float eps, int64_t N, int64_t H, float* op) {
  at::parallel_for(0, N, norm_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * H, wp, eps, H, op + r * H);
  });
}

// ---------------------------------------------------------------------------------------------- linear

// oneDNN's fp32 product (mkldnn::_linear_pointwise, what model.linear calls) has no at:: function: it is
// looked up in the dispatcher once and called unboxed.
using OneDnnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                c10::string_view, c10::List<std::optional<at::Scalar>>,
                                std::optional<c10::string_view>);

const c10::TypedOperatorHandle<OneDnnLinear>* onednn_linear_op() {
  static const auto* op = []() -> const c10::TypedOperatorHandle<OneDnnLinear>* {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle.has_value()) return nullptr;
    return new c10::TypedOperatorHandle<OneDnnLinear>(handle->typed<OneDnnLinear>());
  }();
  return op;
}

}  // namespace

// ---------------------------------------------------------------------------------------- single ops

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
  const int64_t Lmax = sc.size(1);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  auto out = torch::empty({B, Hq, D}, qc.options());
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= Lmax, "paged_decode: a length outside 1..Lmax");
    for (int64_t l = 0; l < lp[b]; ++l) {
      TORCH_CHECK(sp[b * Lmax + l] >= 0 && sp[b * Lmax + l] < num_slots, "paged_decode: a slot outside the cache");
    }
  }
  const float* qp = qc.data_ptr<float>();
  const float* kp = key_cache.data_ptr<float>();
  const float* vp = value_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<const int64_t*> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = sp + b * Lmax;
  attend(qp, rows.data(), lp, B, kp, vp, Hq, Hkv, D, static_cast<float>(scale), op);
  return out;
}

// weight * (x / rms(x)) over the last dim of a float32 x (any leading shape).
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
  rms_norm_rows(xp, wp, static_cast<float>(eps), N, H, op);
  return out;
}

// q [T, Hq, D] and k [T, Hk, D] (any strides in T and H, D contiguous): optional per-head RMSNorm (qw/kw
// [D], or empty tensors for none), then neox RoPE with cos and signed_sin [T, 1, D]. Returns new
// contiguous q and k.
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

// Per row of a float32 [N, V] x, the index of its largest value (the first, on ties), as torch.argmax:
// one pass for the maximum (vectorised), one for where it first occurs. ~4x faster than torch's for a
// step's [32, 8192] logits.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "argmax_rows: a float32 [N, V] tensor");
  auto xc = x.contiguous();
  const int64_t N = xc.size(0), V = xc.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: rows must not be empty");
  auto out = torch::empty({N}, xc.options().dtype(torch::kInt64));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Rows in parallel only when there is a lot of them: waking the other threads costs more than a few.
  at::parallel_for(0, N, std::max<int64_t>(1, (1 << 19) / V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * V;
      float mx = row[0];
      for (int64_t i = 1; i < V; ++i) mx = std::max(mx, row[i]);
      int64_t at = 0;
      while (at < V && !(row[at] == mx)) ++at;
      op[r] = at < V ? at : 0;
    }
  });
  return out;
}

// -------------------------------------------------------------------------------------------- decoder

namespace {

// One product's weight: the plain [out, in] tensor, its oneDNN-packed copy (undefined when not packed:
// model.prepack_linear_weights) and an optional bias.
struct Linear {
  at::Tensor weight, packed;
  std::optional<at::Tensor> bias;
};

struct Layer {
  at::Tensor input_norm, post_norm;  // [hidden]
  at::Tensor q_norm, k_norm;         // [head_dim], or undefined (no per-head norm)
  Linear qkv, o, gate_up, down;
};

Linear make_linear(const std::vector<at::Tensor>& w, size_t i) {
  // w[i]: weight, w[i+1]: packed or an empty tensor, w[i+2]: bias or an empty tensor
  Linear l;
  l.weight = w.at(i);
  if (w.at(i + 1).numel() > 0) l.packed = w.at(i + 1);
  if (w.at(i + 2).numel() > 0) l.bias = w.at(i + 2);
  return l;
}

}  // namespace

// A decoder's weights (references to the model's own tensors: nothing is copied) and its forward.
class Decoder {
 public:
  // `lm_head`: (weight, packed, bias) as below. `layers`: per layer 16 tensors: input norm, post-attention
  // norm, q norm, k norm (empty: none), then (weight, packed, bias) for qkv, o, gate_up and down (an empty
  // packed or bias tensor: none).
  Decoder(at::Tensor embed, at::Tensor final_norm, std::vector<at::Tensor> lm_head,
          std::vector<std::vector<at::Tensor>> layers, double eps, int64_t num_heads, int64_t num_kv_heads,
          int64_t head_dim, bool use_onednn)
      : embed_(std::move(embed)), final_norm_(std::move(final_norm)), eps_(static_cast<float>(eps)),
        Hq_(num_heads), Hkv_(num_kv_heads), D_(head_dim),
        onednn_(use_onednn ? onednn_linear_op() : nullptr) {
    TORCH_CHECK(Hq_ % Hkv_ == 0 && D_ % 2 == 0, "Decoder: head shapes do not match");
    TORCH_CHECK(lm_head.size() == 3, "Decoder: (weight, packed, bias) for the LM head");
    lm_head_ = make_linear(lm_head, 0);
    for (const auto& w : layers) {
      TORCH_CHECK(w.size() == 16, "Decoder: 16 tensors per layer");
      Layer l;
      l.input_norm = w[0];
      l.post_norm = w[1];
      if (w[2].numel() > 0) l.q_norm = w[2];
      if (w[3].numel() > 0) l.k_norm = w[3];
      l.qkv = make_linear(w, 4);
      l.o = make_linear(w, 7);
      l.gate_up = make_linear(w, 10);
      l.down = make_linear(w, 13);
      TORCH_CHECK(l.qkv.weight.size(0) == (Hq_ + 2 * Hkv_) * D_, "Decoder: qkv weight shape");
      layers_.push_back(std::move(l));
    }
  }

  // One step. `ids`: the step's T tokens flattened, sequence i owning ids[query_start_loc[i] ..
  // query_start_loc[i+1]); seq_lens[i]: its context length including this step's tokens; block_tables[i]:
  // its physical blocks, covering that context. `cos`, `signed_sin` [P, D]: model.rope_tables of positions
  // 0 .. P-1. Each token's K/V is written into the caches (one [NB, block_size, Hkv, D] per layer) at its
  // position's slot, then it attends causally over its sequence's context. Returns the final-normed
  // hidden states [T, hidden] and the logits [R, vocab] of the rows `logit_rows` (the LM head's product
  // on those rows only). Plain lists in: the engine's step never builds index tensors for this path.
  std::tuple<at::Tensor, at::Tensor> forward(const std::vector<int64_t>& ids, const std::vector<int64_t>& qsl,
                                             const std::vector<int64_t>& lens,
                                             const std::vector<std::vector<int64_t>>& block_tables,
                                             int64_t block_size, const at::Tensor& cos, const at::Tensor& signed_sin,
                                             const std::vector<at::Tensor>& key_caches,
                                             const std::vector<at::Tensor>& value_caches,
                                             const std::vector<int64_t>& logit_rows) {
    const int64_t T = static_cast<int64_t>(ids.size());
    const int64_t B = static_cast<int64_t>(lens.size());
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(),
                "Decoder.forward: one key and one value cache per layer");
    TORCH_CHECK(static_cast<int64_t>(qsl.size()) == B + 1 && static_cast<int64_t>(block_tables.size()) == B,
                "Decoder.forward: metadata shapes");
    TORCH_CHECK(B > 0 && qsl[0] == 0 && qsl[B] == T, "Decoder.forward: query_start_loc does not cover the tokens");
    TORCH_CHECK(block_size > 0, "Decoder.forward: block_size must be positive");
    const int64_t num_slots = key_caches[0].size(0) * key_caches[0].size(1);
    const int64_t vocab = embed_.size(0);

    // Every sequence's context slots, and each token's sequence and position (checked once, here).
    std::vector<int64_t> ctx_offset(B + 1, 0);
    for (int64_t i = 0; i < B; ++i) ctx_offset[i + 1] = ctx_offset[i] + lens[i];
    std::vector<int64_t> ctx_slots(ctx_offset[B]);
    std::vector<int64_t> token_pos(T), token_len(T);
    std::vector<const int64_t*> token_slots(T);  // where each token's context slots start
    for (int64_t i = 0; i < B; ++i) {
      const int64_t q_len = qsl[i + 1] - qsl[i];
      TORCH_CHECK(q_len >= 1 && q_len <= lens[i], "Decoder.forward: a sequence with no new tokens");
      const auto& table = block_tables[i];
      TORCH_CHECK((lens[i] + block_size - 1) / block_size <= static_cast<int64_t>(table.size()),
                  "Decoder.forward: a block table too short for its context");
      int64_t* out = ctx_slots.data() + ctx_offset[i];
      for (int64_t p0 = 0, b = 0; p0 < lens[i]; p0 += block_size, ++b) {
        const int64_t base = table[b] * block_size;
        TORCH_CHECK(table[b] >= 0 && base + block_size <= num_slots, "Decoder.forward: a block outside the cache");
        const int64_t count = std::min(block_size, lens[i] - p0);
        for (int64_t j = 0; j < count; ++j) out[p0 + j] = base + j;
      }
      for (int64_t t = qsl[i]; t < qsl[i + 1]; ++t) {
        TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "Decoder.forward: a token id outside the vocabulary");
        token_pos[t] = lens[i] - (qsl[i + 1] - t);
        token_len[t] = token_pos[t] + 1;
        token_slots[t] = out;
      }
    }
    const float scale = static_cast<float>(std::pow(static_cast<double>(D_), -0.5));  // Python's D ** -0.5
    auto cc = cos.contiguous();
    auto sc = signed_sin.contiguous();
    int64_t max_pos = 0;
    for (int64_t t = 0; t < T; ++t) max_pos = std::max(max_pos, token_pos[t]);
    TORCH_CHECK(cc.dim() == 2 && cc.size(1) == D_ && sc.sizes() == cc.sizes() && cc.size(0) > max_pos,
                "Decoder.forward: cos/sin must be [P, D] with a row for every position");
    const int64_t Hd = embed_.size(1);
    at::Tensor x = at::empty({T, Hd}, embed_.options());  // the residual stream, updated in place
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(x.data_ptr<float>() + t * Hd, embed_.data_ptr<float>() + ids[t] * Hd, Hd * sizeof(float));
    }
    at::Tensor h = at::empty_like(x);
    float* xp = x.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    rms_norm_rows(xp, layers_[0].input_norm.data_ptr<float>(), eps_, T, Hd, hp);
    at::Tensor q = at::empty({T, Hq_, D_}, x.options());
    at::Tensor k = at::empty({T, Hkv_, D_}, x.options());
    at::Tensor o = at::empty({T, Hq_ * D_}, x.options());
    const int64_t row_kv = Hkv_ * D_;
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      at::Tensor qkv = linear(h, L.qkv);
      const float* qkvp = qkv.data_ptr<float>();
      const int64_t W = qkv.size(1);
      norm_rope_rows(qkvp, W, D_, T, Hq_, D_, L.q_norm.defined() ? L.q_norm.data_ptr<float>() : nullptr, eps_,
                     cc.data_ptr<float>(), sc.data_ptr<float>(), q.data_ptr<float>(), token_pos.data());
      norm_rope_rows(qkvp + Hq_ * D_, W, D_, T, Hkv_, D_, L.k_norm.defined() ? L.k_norm.data_ptr<float>() : nullptr,
                     eps_, cc.data_ptr<float>(), sc.data_ptr<float>(), k.data_ptr<float>(), token_pos.data());
      float* kcp = key_caches[li].data_ptr<float>();
      float* vcp = value_caches[li].data_ptr<float>();
      const float* kp = k.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = token_slots[t][token_pos[t]];
        std::memcpy(kcp + slot * row_kv, kp + t * row_kv, row_kv * sizeof(float));
        std::memcpy(vcp + slot * row_kv, qkvp + t * W + (Hq_ + Hkv_) * D_, row_kv * sizeof(float));
      }
      attend(q.data_ptr<float>(), token_slots.data(), token_len.data(), T, kcp, vcp, Hq_, Hkv_, D_, scale,
             o.data_ptr<float>());
      at::Tensor a = linear(o, L.o);
      add_rms_rows(xp, a.data_ptr<float>(), L.post_norm, T, Hd, hp);
      at::Tensor gu = linear(h, L.gate_up);
      const int64_t I = gu.size(1) / 2;
      at::Tensor m = at::empty({T, I}, gu.options());
      silu_mul_rows(gu.data_ptr<float>(), T, I, m.data_ptr<float>());
      at::Tensor d = linear(m, L.down);
      const at::Tensor& next_norm = li + 1 < layers_.size() ? layers_[li + 1].input_norm : final_norm_;
      add_rms_rows(xp, d.data_ptr<float>(), next_norm, T, Hd, hp);
    }
    const int64_t R = static_cast<int64_t>(logit_rows.size());
    if (R == 0) return {h, at::empty({0, lm_head_.weight.size(0)}, h.options())};
    // model.compute_logits: the LM head on the rows that sample
    at::Tensor rows = at::empty({R, Hd}, h.options());
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(logit_rows[r] >= 0 && logit_rows[r] < T, "Decoder.forward: a logit row outside the step");
      std::memcpy(rows.data_ptr<float>() + r * Hd, hp + logit_rows[r] * Hd, Hd * sizeof(float));
    }
    return {h, linear(rows, lm_head_)};
  }

 private:
  // model.linear: the packed oneDNN product where there is one, plain oneDNN above the sizes where it
  // wins, else MKL (at::linear).
  at::Tensor linear(const at::Tensor& x, const Linear& l) const {
    if (onednn_ != nullptr) {
      if (l.packed.defined()) return onednn_->call(x, l.packed, l.bias, "none", c10::List<std::optional<at::Scalar>>(), "");
      const int64_t wn = l.weight.size(0) * l.weight.size(1);
      if (wn >= (int64_t{1} << 16) && x.size(0) * wn >= (int64_t{1} << 20)) {
        return onednn_->call(x, l.weight, l.bias, "none", c10::List<std::optional<at::Scalar>>(), "");
      }
    }
    return at::linear(x, l.weight, l.bias);
  }

  // SwiGLU's silu(gate) * up for rows of gu = [gate | up] (each I wide): torch's formula, x / (1 + exp(-x)),
  // then the product, in one pass instead of two ops and an intermediate tensor.
  static void silu_mul_rows(const float* gp, int64_t N, int64_t I, float* op) {
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* g = gp + r * 2 * I;
        const float* u = g + I;
        float* o = op + r * I;
        for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      }
    });
  }

  // x += a (the residual add, rounded as torch's add), then h = rms_norm(x).
  void add_rms_rows(float* xp, const float* ap, const at::Tensor& w, int64_t N, int64_t H, float* op) const {
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, norm_grain(H), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* xr = xp + r * H;
        const float* ar = ap + r * H;
        for (int64_t d = 0; d < H; ++d) xr[d] = xr[d] + ar[d];
        rms_norm_row(xr, wp, eps_, H, op + r * H);
      }
    });
  }

  at::Tensor embed_, final_norm_;
  Linear lm_head_;
  float eps_;
  int64_t Hq_, Hkv_, D_;
  const c10::TypedOperatorHandle<OneDnnLinear>* onednn_;
  std::vector<Layer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged cache");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("qk_norm_rope", &qk_norm_rope, "per-head q/k RMSNorm and RoPE");
  m.def("argmax_rows", &argmax_rows, "the first index of each row's largest value");
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>,
                          double, int64_t, int64_t, int64_t, bool>())
      .def("forward", &Decoder::forward);
}
