"""The engine's pure core: requests, sampling parameters, the block pool, the scheduler and the stop checker.

Nothing here imports torch or does I/O: the scheduler decides admission, preemption and chunking as data
(``SchedulerOutput``) and ``engine_core.py`` hands that to the model runner.

  request.py          Request and RequestStatus: one sequence's tokens, blocks and state
  sampling_params.py  SamplingParams: the engine's validated sampling knobs (no API dialect)
  block_pool.py       paged KV blocks, their reference counts and the prefix-cache hash chain
  scheduler.py        continuous batching: admission, chunked prefill, preemption, prefix hits
  stop_checker.py     stop strings, stop tokens and length limits over the detokenised text
"""
