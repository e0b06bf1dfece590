"""Triton kernels for the engine's CUDA path, and the torch references they are tested against.

Every kernel here has an oracle in torch: the attention kernels are checked against
``services.engine.model.attention.TorchPagedAttention`` (and ``KVCache.write`` for the cache write), the
elementwise kernels against :mod:`services.engine.kernels.reference`, which follows ``model.py``'s
numerics op for op. The backend built from them (``TritonPagedAttention``) and the CUDA-graph buffers
live in ``services/engine/model/``: they are model wiring, not kernels. The tests run the kernels on CPU
under ``TRITON_INTERPRET=1`` (tests/unit/engine/test_triton_kernels.py); ``bench/gpu_bench.py`` repeats
the comparison on a GPU at realistic sizes.

Modules (one noun each):
  backend.py          which backend a device gets ("triton" on CUDA when triton imports, else "torch")
  reference.py        torch references for the elementwise kernels (pure torch, importable anywhere)
  kv_write.py         scatter new K/V into cache slots, fp8 quantisation included
  decode_attention.py split-KV (flash-decoding) paged attention for one-token queries, GQA-grouped
  extend_attention.py causal attention of a chunk of new tokens over the paged cache (prefill, verify)
  rms_norm.py         RMSNorm, optionally fused with the residual add
  rope.py             neox-style rotary embedding from a cos/sin cache, in place on q and k
  activation.py       SiLU-and-mul (SwiGLU's gate)
  fp8.py              the fp8 KV format (FP8_DTYPE, FP8_MAX) the kernels and the KV cache share
  quant_gemm.py       quantized GEMMs dequantising in the tile (INT4/INT8, NVFP4 weight-only; FP8 with scale
                      groups, fp8 x fp8 for W8A8); oracle: model/quant/formats.py + a matmul
                      (test_quant_triton.py, test_quant_triton_dispatch.py)
  fused_moe.py        every expert's GEMM of a step in one launch (tokens sorted and padded by expert), dense
                      or quantized experts; oracle: MoE.forward (test_fused_moe.py)
  cpu_kernels.py      not Triton: the CPU path's compiled C++ (cpu_kernels.cpp, built on first use with
                      torch.utils.cpp_extension): the whole decoder forward of a step in one call, and
                      the decode attention, RMSNorm, q/k norm + RoPE and argmax on their own; oracles:
                      the torch model path and TorchPagedAttention (test_compiled_decoder.py,
                      test_cpu_kernels.py)

Importing this package imports neither triton nor the kernels: only ``backend`` and ``reference`` are
safe where triton is missing. The kernel modules import triton at module import time, so under the
interpreter ``TRITON_INTERPRET=1`` must be set before they are first imported (triton reads it when
``@triton.jit`` decorates a function).

Interpreter caveats found with triton 3.9 (why the kernels are written the way they are):
* arithmetic on bfloat16 values without an explicit upcast is wrong in the interpreter (``x * 2`` on a
  bf16 load gives garbage), so every kernel loads, upcasts to float32, computes, and casts once on store;
* the interpreter's float32 -> float8e4nv cast mis-rounds when the rounding carries into the exponent
  (31.66 -> 16, not 32), so the fp8 tests feed values that are already on the e4m3 grid (see the tests).
"""
