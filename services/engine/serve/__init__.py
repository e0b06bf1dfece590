"""The engine's faces: HTTP (OpenAI API and telemetry) and the bus worker, over one request translation.

  frontend.py       the one request/response translation both faces share (prompts, params, errors, chunks)
  http.py           EngineService: the OpenAI-compatible HTTP API, /metrics, /slots, /usage
  worker.py         BusWorker: GenerateRequests from NATS, TokenChunks back, deadlines enforced
  async_engine.py   AsyncEngine / ProcessEngine: the step loop off the event loop (thread or child process)
  views.py          response bodies for /metrics, /slots and /usage
  energy.py         energy meters (NVML, RAPL) and the per-request energy tracker
  usage_ledger.py   the per-UTC-day usage ledger persisted across restarts
"""
