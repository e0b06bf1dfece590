"""ninfer-serve's HTTP API as an OpenAPI 3.1 document (served at ``/openapi.json``): the OpenAI routes
with the gateway's request schemas (services/common/openapi_spec.py) and the telemetry endpoints.
A test holds it to the routes the app serves; tests/faults/test_openapi_fuzz.py fuzzes it."""

from __future__ import annotations

from typing import Any

from services.common.openapi_spec import CHAT, COMPLETION, EMBEDDINGS, RESPONSES, get, model_path, post
from services.common.openapi_spec import document as build


def document() -> dict[str, Any]:
    return build("ninfer-serve", {
        "/v1/chat/completions": post("Chat completion", CHAT),
        "/v1/completions": post("Text completion", COMPLETION),
        "/v1/embeddings": post("Embeddings: the last (or mean, --pooling) final hidden state, L2-normalised",
                               EMBEDDINGS),
        "/v1/responses": post("Responses API (text, function tools, text.format; streamed events), on the chat "
                              "path", RESPONSES),
        "/v1/models": get("The one model this engine serves", ("401",)),
        "/v1/models/{model_id}": model_path("The model, by id"),
        "/health": get("ok, or 503 when the engine's step loop failed", ("503",)),
        "/slots": get("NInfer-style lanes and KV pages"),
        "/usage": get("NInfer-style tokens, throughput and energy"),
        "/metrics": get("Prometheus metrics"),
        "/openapi.json": get("This document"),
    }, "--api-key, when the engine was started with one (the /v1 routes only)")
