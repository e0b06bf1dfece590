"""Telemetry: brings engines that only speak HTTP onto the bus (docs/telemetry.md).

Each HTTP member is scraped on its own loop; what it speaks is detected from what it answers (NInfer
``/slots`` + ``/usage``, vLLM / llama.cpp / SGLang ``/metrics``, llama.cpp's ``/slots`` array or ``/props``,
SGLang's server info, else a stock OpenAI server reachable on ``/v1/models`` or ``/health``) and turned into a
normalized SlotHeartbeat on ``llm.v1.hb.<member_id>`` and the ``llm_workers`` KV bucket, with null for every
figure the engine does not give and ``signal_sources`` saying where each one came from. Engine-reported energy
goes to the ENERGY stream.

Modules: ``promparse`` (Prometheus text parser) and ``normalize`` (bodies → Reading) and ``lanes`` (lanes where
the engine does not say: declared, learned, default) and ``probe`` (health, heartbeat and energy-sample
building) and ``schedule`` (when each member's scrape fires, each request's deadline) and ``discovery`` and
``views`` are pure; ``scraper`` (HTTP) and ``service`` (loops, bus, telemetry's own /metrics) are the I/O shell.

Errors: ``promparse.PromParseError`` (a ``/metrics`` line that is not Prometheus text) and
``normalize.MalformedBody`` (a body that cannot be what its endpoint should answer) are raised by the pure
core; ``scraper.ScrapeError`` (member, endpoint, reason) is the one failure the shell acts on — raised for a
request that still fails after its one retry (each request has its own deadline), it counts as a failed
scrape; nothing a member answers can stop the loop.
"""
