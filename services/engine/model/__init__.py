"""The model side of the engine: config, weights, the torch model, attention and its KV cache, the runner.

  model_config.py     ModelConfig parsed from config.json (which architectures run)
  artifact.py         materialise a model reference into a local checkpoint (``ninfer`` CLI)
  loader.py           safetensors weights into CausalLM (and the MTP head), backend-aware
  model.py            the decoder: CausalLM, DecoderLayer, RMSNorm, rotary tables
  mtp_head.py         the multi-token-prediction module loaded from ``mtp.*`` tensors
  attention.py        the attention backend interface, metadata, the paged KV cache and the torch path
  kv_cache.py         how many KV blocks fit: device free memory and the memory fraction
  triton_attention.py TritonPagedAttention: the AttentionBackend over the Triton kernels
  cuda_graphs.py      batch-size buckets and static buffers for CUDA-graph decode
  model_runner.py     one forward step over scheduled sequences (prefill chunks and decodes)
  sampler.py          logits to tokens: penalties, temperature, top-k/p, logprobs
  tokenizer.py        tokenizer, chat template and the incremental detokenizer
"""
