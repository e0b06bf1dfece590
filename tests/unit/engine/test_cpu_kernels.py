"""The fused CPU decode attention (kernels/cpu_kernels.py) against the torch decode path it replaces."""

from __future__ import annotations

import os
import random

import pytest
import torch

from services.engine.kernels import cpu_kernels
from services.engine.model.attention import SeqSpan, TorchPagedAttention, build_attention_metadata
from services.engine.model.kv_cache import KVCache, KVCacheSpec

fused = cpu_kernels.fused_decode()
# Under CI (.ci/run installs g++ and sets LLMGW_CI=1) a kernel that cannot be built fails instead of skipping.
needs_kernel = pytest.mark.skipif(fused is None and os.environ.get("LLMGW_CI") != "1",
                                  reason="no C++ compiler: the fused kernel could not be built")


def _filled_cache(spans: list[SeqSpan], heads: int, dim: int, block: int) -> KVCache:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=heads, head_dim=dim, block_size=block, dtype=torch.float32)
    cache = KVCache.for_capacity_tokens(spec, 8192, "cpu")
    for layer in range(2):
        for span in spans:
            if span.start_pos:
                meta, _ = build_attention_metadata([SeqSpan(0, span.start_pos, span.block_table)], block, "cpu")
                cache.write(layer, torch.randn(span.start_pos, heads, dim), torch.randn(span.start_pos, heads, dim),
                            meta.slot_mapping)
    return cache


def _spans(lens_new: list[tuple[int, int]], block: int, rng: random.Random) -> list[SeqSpan]:
    """Sequences with (cached, new) tokens on shuffled blocks (block 0 unused, as the pool does)."""
    need = sum(-(-(c + n) // block) for c, n in lens_new)
    free = list(range(1, need + 1))
    rng.shuffle(free)
    spans = []
    for cached, new in lens_new:
        k = -(-(cached + new) // block)
        spans.append(SeqSpan(cached, new, free[:k]))
        free = free[k:]
    return spans


@needs_kernel
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(8, 4, 32), (4, 4, 16), (16, 2, 64), (6, 1, 8)])
def test_the_fused_decode_equals_the_torch_decode(q_heads: int, kv_heads: int, dim: int) -> None:
    assert fused is not None, "the fused kernel did not build (see the warning logged)"
    torch.manual_seed(1)
    rng = random.Random(1)
    block = 16
    # every context length shape: 1 token, within one block, exactly a block, many blocks, very different
    lens = [0, 3, 15, 16, 17, 40, 200, 383, 64, 5, 127, 128]
    spans = _spans([(n, 1) for n in lens], block, rng)
    cache = _filled_cache(spans, kv_heads, dim, block)
    meta, _ = build_attention_metadata(spans, block, "cpu")
    q = torch.randn(len(spans), q_heads, dim)
    k, v = torch.randn(len(spans), kv_heads, dim), torch.randn(len(spans), kv_heads, dim)
    for layer in (0, 1):
        want = TorchPagedAttention().forward(layer, q, k, v, meta, cache)
        got = TorchPagedAttention(fused).forward(layer, q, k, v, meta, cache)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_a_step_mixing_prompt_chunks_and_decodes_uses_the_kernel_for_the_decodes_only() -> None:
    assert fused is not None, "the fused kernel did not build (see the warning logged)"
    torch.manual_seed(2)
    rng = random.Random(2)
    spans = _spans([(30, 1), (0, 24), (50, 1), (16, 9), (7, 1)], 8, rng)
    cache = _filled_cache(spans, 2, 16, 8)
    meta, _ = build_attention_metadata(spans, 8, "cpu")
    tokens = sum(s.num_new_tokens for s in spans)
    q, k, v = torch.randn(tokens, 4, 16), torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)
    want = TorchPagedAttention().forward(0, q, k, v, meta, cache)
    got = TorchPagedAttention(fused).forward(0, q, k, v, meta, cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_bad_addresses_are_refused_not_read() -> None:
    assert fused is not None, "the fused kernel did not build (see the warning logged)"
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    cache = KVCache(spec, 2)
    q = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused(q, cache.key_caches[0], cache.value_caches[0], torch.tensor([[0, 99]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="length outside"):
        fused(q, cache.key_caches[0], cache.value_caches[0], torch.tensor([[0, 1]]), torch.tensor([3]), 1.0)


def test_other_dtypes_and_fp8_caches_keep_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    backend = TorchPagedAttention(lambda *a: calls.append(a))  # type: ignore[arg-type,func-returns-value]
    spans = _spans([(10, 1)], 4, random.Random(0))
    for dtype, kv in ((torch.float32, "fp8"), (torch.bfloat16, "auto")):
        spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=dtype, kv_cache_dtype=kv)  # type: ignore[arg-type]
        cache = KVCache.for_capacity_tokens(spec, 64, "cpu")
        meta, _ = build_attention_metadata(spans, 4, "cpu")
        q = torch.randn(1, 1, 8, dtype=dtype)
        backend.forward(0, q, q.clone(), q.clone(), meta, cache)
    assert calls == []


def test_the_kernel_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "0")
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "paged_decode", None)
    assert cpu_kernels.fused_decode() is None


def test_a_failed_build_falls_back_and_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_SOURCE", "this is not C++")
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "paged_decode", None)
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        assert cpu_kernels.fused_decode() is None
    assert "using the slower torch path" in caplog.text and "g++" in caplog.text


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 256), (32, 256), (5, 8, 32), (3, 1024), (0, 64)])
def test_the_compiled_rms_norm_equals_torch_within_float_rounding(shape: tuple[int, ...]) -> None:
    assert fused is not None and cpu_kernels.rms_norm is not None
    torch.manual_seed(3)
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1])
    want = torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-6)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-6), want, rtol=2e-6, atol=2e-6)
    # a non-contiguous view (a per-head norm over q inside the fused qkv output) reads the same values
    view, head_w = torch.randn(4, 3 * 32)[:, :64].view(4, 2, 32), torch.randn(32)
    torch.testing.assert_close(cpu_kernels.rms_norm(view, head_w, 1e-6),
                               torch.nn.functional.rms_norm(view, (32,), head_w, 1e-6), rtol=2e-6, atol=2e-6)


def test_the_ninja_wheel_is_put_on_path_when_no_ninja_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    ninja = pytest.importorskip("ninja")
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    cpu_kernels._put_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert os.path.exists(os.path.join(ninja.BIN_DIR, "ninja"))


@needs_kernel
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(8, 4, 32), (16, 8, 64), (4, 1, 8)])
def test_the_compiled_qk_norm_and_rope_equal_the_torch_ops(q_heads: int, kv_heads: int, dim: int) -> None:
    from services.engine.model import model

    assert fused is not None and cpu_kernels.qk_norm_rope is not None
    torch.manual_seed(4)
    tokens = 6
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim)  # q and k as views into one projection
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, signed_sin = model.rope_tables(torch.tensor([0, 1, 9, 77, 4095, 3]), inv_freq, torch.float32)
    qw, kw = torch.randn(dim), torch.randn(dim)
    got_q, got_k = cpu_kernels.qk_norm_rope(q, k, cos, signed_sin, qw, kw, 1e-6)
    f = torch.nn.functional.rms_norm
    torch.testing.assert_close(got_q, model._apply_rope(f(q, (dim,), qw, 1e-6), cos, signed_sin), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got_k, model._apply_rope(f(k, (dim,), kw, 1e-6), cos, signed_sin), rtol=2e-6, atol=2e-6)
    # without the per-head norm (Llama, Qwen2) RoPE alone is bit-identical to the torch ops
    none = torch.empty(0)
    got_q, got_k = cpu_kernels.qk_norm_rope(q, k, cos, signed_sin, none, none, 0.0)
    assert torch.equal(got_q, model._apply_rope(q, cos, signed_sin))
    assert torch.equal(got_k, model._apply_rope(k, cos, signed_sin))


@needs_kernel
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(8, 4, 128), (4, 4, 48), (6, 2, 32)])
def test_one_long_context_is_split_across_threads_and_merged_exactly(q_heads: int, kv_heads: int, dim: int) -> None:
    """A single decode over 3,000 positions is cut into one piece per thread (flash-decoding): the merged
    result equals the torch path. Head sizes: vectorised (128), the any-size fallback (48), unpaired
    heads (three query heads per KV head: taken one at a time)."""
    assert fused is not None, "the fused kernel did not build (see the warning logged)"
    torch.manual_seed(6)
    spans = _spans([(2999, 1), (40, 1)], 16, random.Random(6))
    cache = _filled_cache(spans, kv_heads, dim, 16)
    meta, _ = build_attention_metadata(spans, 16, "cpu")
    q = torch.randn(2, q_heads, dim)
    k, v = torch.randn(2, kv_heads, dim), torch.randn(2, kv_heads, dim)
    want = TorchPagedAttention().forward(0, q, k, v, meta, cache)
    got = TorchPagedAttention(fused).forward(0, q, k, v, meta, cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
