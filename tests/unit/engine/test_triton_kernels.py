"""The Triton kernels (services/engine/kernels) against their torch oracles, on CPU under TRITON_INTERPRET=1.

Oracles: ``TorchPagedAttention`` and ``KVCache.write`` (attention.py) for the attention kernels and the
cache write, ``kernels.reference`` for the elementwise kernels (itself pinned to model.py's functions
below). Sizes are toys on purpose: head counts, head dims, widths and block sizes are *not* powers of two
(6 query heads over 2 KV heads, head_dim 24, block_size 3), so every masked edge of every kernel runs.

How the interpreter is used: triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel,
i.e. when a kernel module is first imported, so this module sets it before importing them (and reloads
them if something imported them earlier without it). With triton 3.9 the interpreter takes CPU torch
tensors directly.

fp8: the interpreter's float32 -> float8e4nv cast mis-rounds whenever rounding carries into the exponent
(31.66 -> 16 instead of 32, measured with triton 3.9.0), while its fp8 -> float32 read is exact. So the
fp8 tests feed K/V values that already lie on the e4m3 grid times a power-of-two scale (x / scale is then
exact and every rounding mode agrees), plus out-of-range values to test saturation to ±448; the reading
and dequantising path is tested on arbitrary stored bytes (a cache filled by torch's own cast). On a GPU,
bench/gpu_bench.py checks the write kernel's rounding on arbitrary values.

Tolerances (max |diff| vs the oracle): float32 1e-5 (different summation order only), float16 2e-3 and
bfloat16 2e-2 for attention (the softmax probabilities are rounded to the value dtype before P @ V, as
flash attention does; the torch path keeps them in float32), 1 ulp-ish for the elementwise kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import import_interpreted

_KERNEL_MODULES = (
    "services.engine.kernels.rms_norm",
    "services.engine.kernels.activation",
    "services.engine.kernels.rope",
    "services.engine.kernels.kv_write",
    "services.engine.kernels.decode_attention",
    "services.engine.kernels.extend_attention",
    "services.engine.model.triton_attention",
)


import_interpreted(*_KERNEL_MODULES)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from services.engine.kernels import reference  # noqa: E402
from services.engine.kernels.activation import silu_and_mul  # noqa: E402
from services.engine.kernels.decode_attention import (  # noqa: E402
    _decode_split_kernel,
    decode_attention,
    default_num_splits,
)
from services.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX  # noqa: E402
from services.engine.kernels.kv_write import write_kv  # noqa: E402
from services.engine.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from services.engine.kernels.rope import rope_  # noqa: E402
from services.engine.model import model as model_module  # noqa: E402
from services.engine.model.attention import (  # noqa: E402
    SeqSpan,
    TorchPagedAttention,
    build_attention_metadata,
)
from services.engine.model.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from services.engine.model.triton_attention import TritonPagedAttention  # noqa: E402

# (atol, rtol). bf16's are wide because the interpreter's float32 -> bfloat16 cast truncates instead of
# rounding to nearest (518 of 1024 randn values differ from torch's cast with triton 3.9.0; fp16 casts are
# exact): up to one bf16 ulp (2^-7 relative) per rounding, and rms_norm rounds twice (normalised value,
# then the weight product), so 4 ulps = 2^-5. On a GPU the cast rounds to nearest; gpu_bench checks there.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 2**-5)}
ATTENTION_ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 24  # GQA group of 3, head_dim padded to 32 in the kernels


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = ELEMENTWISE_TOL[dtype]
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.fixture(autouse=True)
def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    # triton imports some of its modules lazily at the first launch (and asserts on the variable there).
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_the_kernels_run_in_the_interpreter() -> None:
    # If this fails, the kernel modules were decorated without TRITON_INTERPRET=1 and would need a GPU.
    assert isinstance(_decode_split_kernel, InterpretedFunction)


# ------------------------------------------------------------------------------------------ elementwise


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_the_reference_on_a_non_power_of_two_width(dtype: torch.dtype) -> None:
    x = torch.randn(5, 48, generator=_gen(0)).to(dtype)
    weight = (1 + 0.1 * torch.randn(48, generator=_gen(1))).to(dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    _assert_close(got, reference.rms_norm(x, weight, 1e-6), dtype)


def test_the_reference_rms_norm_is_model_py_rms_norm() -> None:
    for dtype in DTYPES:
        x = torch.randn(5, 48, generator=_gen(0)).to(dtype)
        weight = (1 + 0.1 * torch.randn(48, generator=_gen(1))).to(dtype)
        assert _max_diff(reference.rms_norm(x, weight, 1e-6), model_module.rms_norm(x, weight, 1e-6)) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_over_heads_reads_a_strided_slice_of_the_fused_qkv_output(dtype: torch.dtype) -> None:
    # Qwen3's q-norm: q is a [T, Hq, D] view into [T, (Hq + 2 Hkv) D], rows not evenly strided overall.
    qkv = torch.randn(4, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=_gen(2)).to(dtype)
    q = qkv[:, : NUM_Q_HEADS * HEAD_DIM].view(4, NUM_Q_HEADS, HEAD_DIM)
    weight = (1 + 0.1 * torch.randn(HEAD_DIM, generator=_gen(3))).to(dtype)
    got = rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape
    _assert_close(got, reference.rms_norm(q, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_updates_the_residual_in_place_and_normalises_the_sum(dtype: torch.dtype) -> None:
    x = torch.randn(3, 40, generator=_gen(4)).to(dtype)
    residual = torch.randn(3, 40, generator=_gen(5)).to(dtype)
    weight = (1 + 0.1 * torch.randn(40, generator=_gen(6))).to(dtype)
    want_out, want_sum = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert new_residual.data_ptr() == residual.data_ptr()
    # The add is one rounding of an exact float32 sum in both: bit-identical, except that the interpreter
    # truncates to bf16 (one ulp, 2^-7 relative, at most).
    if dtype == torch.bfloat16:
        torch.testing.assert_close(residual.float(), want_sum.float(), atol=0.0, rtol=2**-7)
    else:
        assert torch.equal(residual, want_sum)
    _assert_close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_rotates_q_and_k_in_place_like_the_reference(dtype: torch.dtype) -> None:
    num_tokens = 5
    qkv = torch.randn(num_tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=_gen(7)).to(dtype)
    q = qkv[:, : NUM_Q_HEADS * HEAD_DIM].view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
    k = qkv[:, NUM_Q_HEADS * HEAD_DIM : (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(
        num_tokens, NUM_KV_HEADS, HEAD_DIM
    )
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    cos, sin = reference.rope_cos_sin_cache(inv_freq, 64)
    positions = torch.tensor([0, 1, 7, 33, 63])
    want_q, want_k = reference.rope(q, positions, cos, sin), reference.rope(k, positions, cos, sin)
    got_q, got_k = rope_(q, k, positions, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    _assert_close(q, want_q, dtype)
    _assert_close(k, want_k, dtype)


def test_the_reference_rope_is_model_py_rope_in_float32() -> None:
    # model.py forms cos/sin per step from positions and folds the sign into signed_sin; same numbers.
    x = torch.randn(4, 3, HEAD_DIM, generator=_gen(8))
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    positions = torch.tensor([0, 5, 6, 40])
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    half = HEAD_DIM // 2
    signed_sin = torch.cat((-emb.sin()[..., :half], emb.sin()[..., half:]), dim=-1)
    want = model_module._apply_rope(x, emb.cos(), signed_sin)
    cos, sin = reference.rope_cos_sin_cache(inv_freq, 41)
    assert _max_diff(reference.rope(x, positions, cos, sin), want) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_the_reference_across_column_blocks(dtype: torch.dtype) -> None:
    x = torch.randn(3, 2 * 40, generator=_gen(9)).to(dtype)
    got = silu_and_mul(x, block=16)  # 40 columns = blocks of 16, 16 and a masked 8
    assert got.shape == (3, 40)
    _assert_close(got, reference.silu_and_mul(x), dtype)


# --------------------------------------------------------------------------------------------- KV write


def _cache(dtype: torch.dtype, kv_cache_dtype: str = "auto", *, block_size: int = 3, num_blocks: int = 24,
           scale: float = 1.0) -> KVCache:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=block_size,
                       dtype=dtype, kv_cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]
    return KVCache(spec, num_blocks, fp8_scale=scale)


def _on_fp8_grid(shape: tuple[int, ...], seed: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Values whose x / scale is exactly an e4m3 number (scale a power of two), in ``dtype``."""
    grid = (torch.randn(shape, generator=_gen(seed)) * 3).to(FP8_DTYPE).float()
    return (grid * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_stores_exactly_what_kv_cache_write_stores(dtype: torch.dtype) -> None:
    kv = torch.randn(5, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=_gen(10)).to(dtype)
    k = kv[:, : NUM_KV_HEADS * HEAD_DIM].view(5, NUM_KV_HEADS, HEAD_DIM)  # strided views, as in the model
    v = kv[:, NUM_KV_HEADS * HEAD_DIM : 2 * NUM_KV_HEADS * HEAD_DIM].view(5, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([70, 3, 4, 5, 41])
    want, got = _cache(dtype), _cache(dtype)
    want.write(1, k, v, slots)
    write_kv(k, v, got.key_caches[1], got.value_caches[1], slots, got.k_scales[1:2], got.v_scales[1:2])
    assert torch.equal(got.key_caches[1], want.key_caches[1])
    assert torch.equal(got.value_caches[1], want.value_caches[1])
    assert not got.key_caches[0].any()  # the other layer untouched


def test_write_kv_skips_negative_slots() -> None:
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=_gen(11))
    cache = _cache(torch.float32)
    slots = torch.tensor([2, -1, 9])
    write_kv(k, k, cache.key_caches[0], cache.value_caches[0], slots, cache.k_scales[:1], cache.v_scales[:1])
    flat = cache.key_caches[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[2], k[0]) and torch.equal(flat[9], k[2])
    assert torch.count_nonzero(flat.abs().sum(dim=(1, 2))) == 2  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_quantises_to_fp8_with_the_scale_and_saturates_at_448(dtype: torch.dtype) -> None:
    scale = 0.5
    k = _on_fp8_grid((4, NUM_KV_HEADS, HEAD_DIM), 12, scale, dtype)
    v = _on_fp8_grid((4, NUM_KV_HEADS, HEAD_DIM), 13, scale, dtype)
    k[0, 0, :3] = torch.tensor([1000.0, -1000.0, 448 * scale])  # beyond ±448 * scale: saturates
    slots = torch.tensor([0, 7, 8, 30])
    want, got = _cache(dtype, "fp8", scale=scale), _cache(dtype, "fp8", scale=scale)
    want.write(0, k, v, slots)
    write_kv(k, v, got.key_caches[0], got.value_caches[0], slots, got.k_scales[:1], got.v_scales[:1])
    assert got.key_caches[0].dtype == FP8_DTYPE
    assert torch.equal(got.key_caches[0].view(torch.uint8), want.key_caches[0].view(torch.uint8))
    assert torch.equal(got.value_caches[0].view(torch.uint8), want.value_caches[0].view(torch.uint8))
    stored = got.key_caches[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[0, 0, :3].float()
    assert stored.tolist() == [FP8_MAX, -FP8_MAX, 448.0]


# -------------------------------------------------------------------------------------------- attention


def _run_step(backend: object, cache: KVCache, spans: list[SeqSpan], q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, layer: int = 1) -> torch.Tensor:
    meta, _ = build_attention_metadata(spans, cache.block_size, "cpu")
    return backend.forward(layer, q, k, v, meta, cache)  # type: ignore[attr-defined]


def _qkv(num_tokens: int, seed: int, dtype: torch.dtype, *, fp8_scale: float | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, generator=_gen(seed)).to(dtype)
    if fp8_scale is not None:
        shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
        return q, _on_fp8_grid(shape, seed + 1, fp8_scale, dtype), _on_fp8_grid(shape, seed + 2, fp8_scale, dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=_gen(seed + 1)).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=_gen(seed + 2)).to(dtype)
    return q, k, v


# Three sequences over shuffled physical blocks of 3 positions: tables never contiguous, never in order.
_TABLES = ([17, 2, 9, 4, 11, 20, 6, 1], [3, 15, 0, 22, 8, 13, 19, 5], [10, 7, 21, 14, 18, 12, 16, 23])
_BACKEND = TritonPagedAttention(num_splits=None, decode_block_n=16, extend_block_m=16, extend_block_n=16)


def _check_steps(dtype: torch.dtype, kv_cache_dtype: str, scale: float) -> None:
    """Prefill (one sequence with 2 cached positions) -> mixed step (chunk + decodes) -> pure decode, each
    step through both backends on twin caches; outputs and caches compared after every step."""
    fp8_scale = scale if kv_cache_dtype == "fp8" else None
    want_cache = _cache(dtype, kv_cache_dtype, scale=scale)
    got_cache = _cache(dtype, kv_cache_dtype, scale=scale)
    torch_backend = TorchPagedAttention()
    steps = [
        # (start_pos, num_new_tokens) per sequence: a 17-token prompt (two 16-row query blocks), a 5-token
        # prompt, and a 4-token chunk behind 2 positions written by an earlier step.
        [(0, 17), (0, 5), (2, 4)],
        [(17, 1), (5, 3), (6, 1)],  # decode, a 3-token chunk (speculative-verify shaped), decode
        [(18, 1), (8, 1), (7, 1)],  # pure decode: the split-KV kernel
    ]
    # The 2 positions "from an earlier step" of sequence 2, written by torch into both caches.
    _, k0, v0 = _qkv(2, 99, dtype, fp8_scale=fp8_scale)
    for cache in (want_cache, got_cache):
        _run_step(torch_backend, cache, [SeqSpan(0, 2, _TABLES[2])], torch.zeros(2, NUM_Q_HEADS, HEAD_DIM,
                  dtype=dtype), k0, v0)
    for step_index, step in enumerate(steps):
        spans = [SeqSpan(start, count, _TABLES[i]) for i, (start, count) in enumerate(step)]
        num_tokens = sum(count for _, count in step)
        q, k, v = _qkv(num_tokens, 10 * step_index, dtype, fp8_scale=fp8_scale)
        want = _run_step(torch_backend, want_cache, spans, q, k, v)
        got = _run_step(_BACKEND, got_cache, spans, q, k, v)
        assert got.dtype == dtype and got.shape == q.shape
        diff = _max_diff(got, want)
        assert diff <= ATTENTION_ATOL[dtype], f"step {step_index}: max |diff| {diff}"
        assert torch.equal(got_cache.key_caches[1].view(torch.uint8), want_cache.key_caches[1].view(torch.uint8))
        assert torch.equal(got_cache.value_caches[1].view(torch.uint8),
                           want_cache.value_caches[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_attention_matches_torch_paged_attention_over_prefill_mixed_and_decode_steps(
    dtype: torch.dtype,
) -> None:
    _check_steps(dtype, "auto", 1.0)


def test_triton_attention_matches_torch_paged_attention_with_an_fp8_cache() -> None:
    _check_steps(torch.bfloat16, "fp8", 0.25)


def _filled_cache(dtype: torch.dtype, kv_cache_dtype: str, num_positions: int, scale: float = 1.0) -> KVCache:
    """A cache whose sequence 0 holds ``num_positions`` arbitrary K/V, written by torch (KVCache.write)."""
    cache = _cache(dtype, kv_cache_dtype, scale=scale)
    k = torch.randn(num_positions, NUM_KV_HEADS, HEAD_DIM, generator=_gen(20)).to(dtype)
    v = torch.randn(num_positions, NUM_KV_HEADS, HEAD_DIM, generator=_gen(21)).to(dtype)
    meta, _ = build_attention_metadata([SeqSpan(0, num_positions, _TABLES[0])], cache.block_size, "cpu")
    cache.write(0, k, v, meta.slot_mapping)
    return cache


@pytest.mark.parametrize("num_splits", [1, 4, 8])
def test_decode_attention_reads_arbitrary_fp8_bytes_and_any_split_count_gives_the_same_answer(
    num_splits: int,
) -> None:
    # 22 positions, tiles of 16: with 8 splits, split_len = ceil(ceil(22 / 8) / 16) * 16 = 16, so splits
    # 2..7 are empty and must drop out of the reduce.
    cache = _filled_cache(torch.float16, "fp8", 22, scale=0.75)
    q = torch.randn(2, NUM_Q_HEADS, HEAD_DIM, generator=_gen(22)).to(torch.float16)
    tables = torch.tensor([_TABLES[0], _TABLES[0]])
    seq_lens = torch.tensor([22, 9])  # the second row reads a prefix of the same blocks
    got = decode_attention(q, cache.key_caches[0], cache.value_caches[0], tables, seq_lens, cache.k_scales[:1],
                           cache.v_scales[:1], num_splits=num_splits, block_n=16)
    keys, values = cache.gather(0, tables[0])  # dequantised by torch: (stored * 0.75) in fp16
    for row, length in enumerate((22, 9)):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[row].unsqueeze(1), keys[:length].transpose(0, 1), values[:length].transpose(0, 1), enable_gqa=True
        ).squeeze(1)
        assert _max_diff(got[row], want) <= ATTENTION_ATOL[torch.float16]


def test_decode_attention_gives_zeros_for_a_padded_row_with_no_context() -> None:
    # CUDA-graph padding rows: seq_len 0, every split empty -> a finite zero row, not NaN.
    cache = _filled_cache(torch.float32, "auto", 5)
    q = torch.randn(2, NUM_Q_HEADS, HEAD_DIM, generator=_gen(23))
    got = decode_attention(q, cache.key_caches[0], cache.value_caches[0], torch.tensor([_TABLES[0], [0] * 8]),
                           torch.tensor([5, 0]), cache.k_scales[:1], cache.v_scales[:1], num_splits=2, block_n=16)
    assert torch.equal(got[1], torch.zeros(NUM_Q_HEADS, HEAD_DIM))
    assert torch.isfinite(got[0]).all()


def test_default_num_splits_fills_the_gpu_but_keeps_splits_at_least_256_tokens_long() -> None:
    # 1 sequence x 8 KV heads = 8 programs per split; 132 SMs -> ceil(132 / 8) = 17; length 4096 -> 16
    # splits of 256; min(16, 17) = 16, a power of two.
    assert default_num_splits(4096, 1, 8) == 16
    assert default_num_splits(300, 1, 8) == 1  # 300 // 256 = 1
    assert default_num_splits(100_000, 1, 8) == 16  # min(390, 17, 32) = 17 -> rounded down to 16
    assert default_num_splits(4096, 64, 8) == 1  # 512 programs already fill 132 SMs


def test_a_padded_decode_batch_gives_the_real_rows_the_unpadded_answer_and_leaves_the_cache_alone() -> None:
    # What a CUDA graph bucket does to 2 real decode rows padded to 4 (kernels/cuda_graphs.py): padded rows
    # have slot -1 (no write) and seq_len 0 (zero output), and the real rows are unaffected.
    from services.engine.model.cuda_graphs import DecodeInputs, StaticDecodeBuffers, decode_metadata

    dtype = torch.float16
    want_cache, got_cache = _filled_cache(dtype, "auto", 13), _filled_cache(dtype, "auto", 13)
    q, k, v = _qkv(2, 30, dtype)
    spans = [SeqSpan(13, 1, _TABLES[0]), SeqSpan(0, 1, _TABLES[1])]
    want = _run_step(TorchPagedAttention(), want_cache, spans, q, k, v, layer=0)
    meta, positions = build_attention_metadata(spans, got_cache.block_size, "cpu")
    inputs = DecodeInputs(input_ids=torch.tensor([5, 6]), positions=positions, slot_mapping=meta.slot_mapping,
                          seq_lens=meta.seq_lens, block_tables=meta.block_tables)
    padded = StaticDecodeBuffers(max_batch_size=4, max_blocks_per_seq=8, device="cpu").fill(inputs, 4)
    pad_q = torch.cat([q, torch.randn(2, NUM_Q_HEADS, HEAD_DIM, generator=_gen(31)).to(dtype)])
    junk = torch.full((2, NUM_KV_HEADS, HEAD_DIM), 7.0, dtype=dtype)  # padded rows' K/V: must not land
    pad_k, pad_v = torch.cat([k, junk]), torch.cat([v, junk])
    backend = TritonPagedAttention(num_splits=2, decode_block_n=16)  # fixed splits, as a graph needs
    got = backend.forward(0, pad_q, pad_k, pad_v, decode_metadata(padded, got_cache.block_size, 14), got_cache)
    assert _max_diff(got[:2], want) <= ATTENTION_ATOL[dtype]
    assert torch.equal(got[2:], torch.zeros(2, NUM_Q_HEADS, HEAD_DIM, dtype=dtype))
    assert torch.equal(got_cache.key_caches[0], want_cache.key_caches[0])
    assert torch.equal(got_cache.value_caches[0], want_cache.value_caches[0])


# -------------------------------------------------------------------------------------- backend choice


def test_backend_defaults_to_triton_on_cuda_and_torch_elsewhere() -> None:
    from services.engine.kernels.backend import select_backend

    assert select_backend("cuda:0", env={}, triton_importable=True) == "triton"
    assert select_backend("cuda", env={}, triton_importable=False) == "torch"
    assert select_backend("cpu", env={}, triton_importable=True) == "torch"


def test_backend_override_argument_beats_the_environment_which_beats_the_rule() -> None:
    from services.engine.kernels.backend import select_backend

    env = {"LLMGW_ENGINE_BACKEND": "torch"}
    assert select_backend("cuda", env=env, triton_importable=True) == "torch"
    assert select_backend("cuda", "triton", env=env, triton_importable=True) == "triton"
    assert select_backend("cuda", "auto", env={"LLMGW_ENGINE_BACKEND": "auto"}, triton_importable=True) == "triton"


def test_an_impossible_backend_choice_fails_loudly_with_the_reason() -> None:
    from services.engine.kernels.backend import BackendUnavailableError, select_backend

    with pytest.raises(BackendUnavailableError, match="not installed"):
        select_backend("cuda", "triton", env={}, triton_importable=False)
    with pytest.raises(BackendUnavailableError, match="not CUDA"):
        select_backend("cpu", env={"LLMGW_ENGINE_BACKEND": "triton"}, triton_importable=True)
    with pytest.raises(BackendUnavailableError, match="LLMGW_ENGINE_BACKEND must be one of"):
        select_backend("cuda", env={"LLMGW_ENGINE_BACKEND": "cutlass"}, triton_importable=True)
    # The interpreter makes triton legal on CPU (these tests).
    assert select_backend("cpu", "triton", env={"TRITON_INTERPRET": "1"}, triton_importable=True) == "triton"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_engine_on_the_triton_backend_generates_the_torch_backend_s_greedy_tokens(tmp_path, arch) -> None:  # type: ignore[no-untyped-def]
    """The whole model wired to the kernels (CausalLM backend="triton"), through EngineCore: prefill, a
    cached-prefix chunk and decode steps give the same greedy tokens as the torch path."""
    from services.engine.llm import LLM, greedy
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / arch, arch=arch)
    prompts = ["the quick brown fox", "the quick brown fox jumps over"]  # the second reuses a cached prefix
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, kv_capacity_tokens=512, max_concurrency=2, backend=backend, block_size=4)
        assert llm.core.backend == backend
        outs[backend] = [c.token_ids for c in llm.generate(prompts, greedy(6, ignore_eos=True))]
    assert outs["triton"] == outs["torch"]


def test_decode_steps_through_the_graph_runner_path_give_the_eager_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """ModelRunner.enable_decode_graphs on CPU without a capture: every one-token decode step goes through
    the static-input path a CUDA graph replays (DecodeInputs, decode_metadata, a fixed split count per
    bucket) and must give the same greedy tokens as the eager path; and a bucket's padded rows must not
    change the real rows' logits."""
    from services.engine.llm import LLM, greedy
    from services.engine.model.cuda_graphs import StaticDecodeBuffers
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3")
    prompts = ["the quick brown fox", "the quick brown fox jumps over", "a"]
    eager = LLM(model, kv_capacity_tokens=512, max_concurrency=3, backend="triton", block_size=4)
    expected = [c.token_ids for c in eager.generate(prompts, greedy(7, ignore_eos=True))]

    llm = LLM(model, kv_capacity_tokens=512, max_concurrency=3, backend="triton", block_size=4)
    runner = llm.core.runner
    runner.enable_decode_graphs(max_batch_size=3, max_context=64, capture=False)
    assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 3)
    decode_batches: list[int] = []
    step_fn = runner.graphs.step_fn
    runner.graphs.step_fn = lambda inputs: (decode_batches.append(inputs.num_seqs), step_fn(inputs))[1]
    got = [c.token_ids for c in llm.generate(prompts, greedy(7, ignore_eos=True))]
    assert got == expected
    assert decode_batches and max(decode_batches) == 3  # the decode steps took the graph path

    # Padding: 2 real rows in a bucket of 4 give the logits of the 2 rows alone, and write no cache block.
    bs = llm.core.config.block_size
    rows = [(5, 9, [1, 2, 3]), (7, 2, [4, 5])]  # (token, position, block table)
    from services.engine.model.cuda_graphs import DecodeInputs

    inputs = DecodeInputs(
        input_ids=torch.tensor([r[0] for r in rows]), positions=torch.tensor([r[1] for r in rows]),
        slot_mapping=torch.tensor([r[2][r[1] // bs] * bs + r[1] % bs for r in rows]),
        seq_lens=torch.tensor([r[1] + 1 for r in rows]),
        block_tables=torch.tensor([r[2] + [0] * (3 - len(r[2])) for r in rows]),
    )
    with torch.inference_mode():
        alone = runner._graph_step(inputs)
        before = [c.clone() for c in llm.core.kv_cache.key_caches]
        padded = runner._graph_step(StaticDecodeBuffers(4, 8, "cpu").fill(inputs, 4))
    assert torch.allclose(padded[:2], alone, atol=1e-5)
    # The real rows rewrote their own slots (with the same K, up to the summation order of a bigger batch);
    # every other slot, the last one too (where a slot of -1 would land if it were not skipped), is as it was.
    real = {r[2][r[1] // bs] * bs + r[1] % bs for r in rows}
    for old_cache, new_cache in zip(before, llm.core.kv_cache.key_caches):
        flat_old, flat_new = old_cache.flatten(0, 1), new_cache.flatten(0, 1)  # [slots, heads, dim]
        others = [i for i in range(flat_old.shape[0]) if i not in real]
        assert torch.equal(flat_old[others], flat_new[others])
        assert torch.allclose(flat_old[sorted(real)], flat_new[sorted(real)], atol=1e-5)


def test_graphs_refuse_an_attention_backend_that_reads_host_lengths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.engine.llm import LLM
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    llm = LLM(write_tiny_checkpoint(tmp_path / "m", arch="qwen3"), kv_capacity_tokens=64, backend="torch")
    assert "CUDA graphs off (cpu, torch backend)" in llm.core.describe()
    with pytest.raises(ValueError, match="triton backend"):
        llm.core.runner.enable_decode_graphs(max_batch_size=2, max_context=32, capture=False)


def test_embeddings_on_the_triton_backend_are_the_torch_backend_s(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """EngineCore.embed through the kernels (the CUDA path; the interpreter here) against the torch path:
    the same pooled, normalised vectors to float32 rounding, for a batch of inputs of different lengths."""
    from services.engine.llm import LLM
    from services.engine.tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3")
    inputs = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(3, 40))]
    vectors = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, kv_capacity_tokens=512, max_concurrency=2, backend=backend, block_size=4)
        vectors[backend] = torch.stack(llm.core.embed("r", inputs, 0.0))
    assert _max_diff(vectors["triton"], vectors["torch"]) < 1e-5
