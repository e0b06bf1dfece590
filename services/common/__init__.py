"""The small shared runtime every service stands on, and nothing else.

What it holds: ``bus.py`` (NATS connection, streams and buckets), ``nats_server.py`` (the embedded
``nats-server``), ``runtime.py`` (config errors, data dir, logging, readiness line, atomic files, running
``main``), ``http.py`` (the OpenAI error body and error middleware, serving an app), ``prom.py`` (Prometheus
text); the OpenAI HTTP dialect the gateway and the engine both speak (``openai_api.py``,
``openai_stream.py``); and ``energy_counter.py``, the one counter rule the engine and accounting share.

The rule: runtime only. Nothing here knows a service's domain (routing, pools, identity, scheduling …
belong to their service), and nothing here imports upward: not a service package, not ``services.cli``
(the composition root, which imports everything).
"""
