"""The gateway's public API as an OpenAPI 3.1 document (served at ``/openapi.json``).

A test checks that every public route the app serves is documented here and nothing else is, so the
document stays true; schemathesis-style fuzzing (issue #12) runs against it.
"""

from __future__ import annotations

from typing import Any

_ERROR = {"description": "OpenAI-style error", "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/Error"}}}}

_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}, {"type": "null"}]},
        "name": {"type": "string"},
    },
}

_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "const": 1},
    "ignore_eos": {"type": "boolean"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 64},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "min_tokens": {"type": "integer", "minimum": 0},
}


def _post(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "parameters": [{"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "pins the conversation to one engine"}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "a completion (JSON), or server-sent events when stream is true"},
                      **{code: _ERROR for code in ("400", "401", "404", "413", "429", "503")}},
    }}


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}, "404": _ERROR}}}


def document() -> dict[str, Any]:
    chat = {"type": "object", "required": ["model", "messages"],
            "properties": {"model": {"type": "string"}, "messages": {"type": "array", "minItems": 1,
                                                                      "items": _MESSAGE}, **_SAMPLING,
                           "logprobs": {"type": "boolean"},
                           "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}}
    completion = {"type": "object", "required": ["model", "prompt"],
                  "properties": {"model": {"type": "string"}, "prompt": {"type": "string"}, **_SAMPLING,
                                 "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}}
    embeddings = {"type": "object", "required": ["model", "input"],
                  "properties": {"model": {"type": "string"},
                                 "input": {"oneOf": [{"type": "string"}, {"type": "array"}]}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmgw gateway", "version": "1"},
        "paths": {
            "/v1/chat/completions": _post("Chat completion, routed to the best engine of the model's pool", chat),
            "/v1/completions": _post("Text completion", completion),
            "/v1/embeddings": _post("Embeddings, passed to members that serve them", embeddings),
            "/v1/models": _get("Pools and aliases clients can name"),
            "/v1/models/{model_id}": {"get": {
                "summary": "One pool", "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK"}, "404": _ERROR}}},
            "/health": _get("Liveness and bus connection"),
            "/backends": _get("Every member with its engine kind, load, heartbeat age and energy"),
            "/metrics": _get("Prometheus metrics"),
            "/openapi.json": _get("This document"),
        },
        "security": [{"apiKey": []}],
        "components": {"securitySchemes": {"apiKey": {
            "type": "http", "scheme": "bearer",
            "description": "An API key (sk-…) from the account page; /backends takes an admin's key"}},
            "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {
            "error": {"type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}},
    }
