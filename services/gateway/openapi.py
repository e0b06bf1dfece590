"""The gateway's public API as an OpenAPI 3.1 document (served at ``/openapi.json``).

A test checks that every public route the app serves is documented here and nothing else is, so the
document stays true; tests/faults/test_openapi_fuzz.py runs schemathesis against it. The request
schemas are the OpenAI dialect's, shared with ninfer-serve (services/common/openapi_spec.py).
"""

from __future__ import annotations

from typing import Any

from services.common.openapi_spec import CHAT, COMPLETION, EMBEDDINGS, RESPONSES, get, model_path, post
from services.common.openapi_spec import document as build

_SESSION = [{"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"},
             "description": "pins the conversation to one engine"}]


def document() -> dict[str, Any]:
    return build("llmgw gateway", {
        "/v1/chat/completions": post("Chat completion, routed to the best engine of the model's pool", CHAT,
                                     parameters=_SESSION),
        "/v1/completions": post("Text completion", COMPLETION, parameters=_SESSION),
        "/v1/embeddings": post("Embeddings, from the pool's members that serve them (ours all do; a member "
                               "that cannot answers 400 model_not_supported)", EMBEDDINGS, parameters=_SESSION),
        "/v1/responses": post("Responses API (text, function tools, text.format; streamed events) for the pool's "
                              "bus members, translated onto the chat path", RESPONSES, parameters=_SESSION),
        "/v1/models": get("Pools and aliases clients can name"),
        "/v1/models/{model_id}": model_path("One pool"),
        "/health": get("Liveness and bus connection"),
        "/backends": get("Every member with its engine kind, load, heartbeat age and energy", ("401", "403")),
        "/metrics": get("Prometheus metrics"),
        "/openapi.json": get("This document"),
    }, "An API key (sk-…) from the account page; /backends takes an admin's key")
