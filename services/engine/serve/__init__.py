"""The engine's faces: HTTP (OpenAI API and telemetry) and the bus worker, over one request translation.

  frontend.py       the one request/response translation both faces share (prompts, params, errors, chunks)
  http.py           EngineService: the OpenAI-compatible HTTP API, /metrics, /slots, /usage
  worker.py         BusWorker: GenerateRequests from NATS, TokenChunks back, deadlines enforced
  async_engine.py   EngineHandle, the step loop, and AsyncEngine: the core on a thread of this process
  process_engine.py ProcessEngine: the core in a child process behind the same EngineHandle
  views.py          response bodies for /metrics, /slots and /usage
  energy.py         energy meters (NVML, RAPL) and the per-request energy tracker
  usage_ledger.py   the per-UTC-day usage ledger persisted across restarts
"""
