"""Telemetry: brings engines that only speak HTTP onto the bus.

This first cut probes each configured HTTP member for reachability (``GET /v1/models``, falling back to
``GET /health``) and publishes a normalized SlotHeartbeat per member with ``engine_kind="stock"``: the
load fields stay null ("no signal"), never a made-up 0. Engine-specific scrapers (NInfer ``/slots`` +
``/usage``, vLLM/llama.cpp/SGLang ``/metrics``) are issue #6.
"""
