"""The OpenAPI 3.1 pieces every service's ``/openapi.json`` is built from: the OpenAI error body, the
request schemas of the OpenAI dialect (``openai_api.py``, ``openai_embeddings.py``) and small path helpers.

One copy because the gateway and ninfer-serve accept the same bodies; a test per service holds its
document to the routes its app serves, and tests/faults/test_openapi_fuzz.py fuzzes every documented
route with schemathesis.
"""

from __future__ import annotations

from typing import Any

ERROR = {"description": "OpenAI-style error", "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/Error"}}}}

MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}, {"type": "null"}]},
        "name": {"type": "string"},
        # an assistant turn's calls, and (required for role tool) the call a tool turn answers
        "tool_calls": {"type": "array", "items": {"type": "object", "required": ["id", "type", "function"],
                                                  "properties": {"id": {"type": "string"},
                                                                 "type": {"const": "function"},
                                                                 "function": {"type": "object",
                                                                              "required": ["name", "arguments"],
                                                                              "properties": {
                                                                                  "name": {"type": "string"},
                                                                                  "arguments": {"type": "string"}}}}}},
        "tool_call_id": {"type": "string"},
        # the legacy form: an assistant turn's one call (a role function turn answers it)
        "function_call": {"type": "object", "required": ["name"],
                          "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}

TOOLS = {
    "tools": {"type": "array", "maxItems": 128, "items": {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                           "description": {"type": "string"}, "parameters": {"type": "object"},
                           "strict": {"type": "boolean"}}}}}},
    "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"const": "function"},
                       "function": {"type": "object", "required": ["name"],
                                    "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": "boolean"},
    # the legacy form of tools and tool_choice (translated to them: openai_api._legacy_functions)
    "functions": {"type": "array", "maxItems": 128, "items": {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                       "description": {"type": "string"}, "parameters": {"type": "object"}}}},
    "function_call": {"oneOf": [{"type": "string", "enum": ["none", "auto"]}, {
        "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}]},
}

SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "ignore_eos": {"type": "boolean"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 64},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "min_tokens": {"type": "integer", "minimum": 0},
}

CHAT = {"type": "object", "required": ["model", "messages"],
        "properties": {"model": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
                       **SAMPLING, **TOOLS, "logprobs": {"type": "boolean"},
                       "reasoning_effort": {"type": "string", "enum": ["none", "minimal", "low", "medium", "high"]},
                       "chat_template_kwargs": {"type": "object"},
                       "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}}
COMPLETION = {"type": "object", "required": ["model", "prompt"],
              "properties": {"model": {"type": "string"}, "prompt": {"type": "string"}, **SAMPLING,
                             "echo": {"type": "boolean"}, "suffix": {"type": "string"},
                             "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}}
# /v1/responses (openai_responses.py): the translated subset; items are checked by the parser (400 naming them)
RESPONSES = {"type": "object", "required": ["model", "input"],
             "properties": {"model": {"type": "string"},
                            "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                                     "items": {"type": "object"}}]},
                            "instructions": {"type": "string"}, "stream": {"type": "boolean"},
                            "max_output_tokens": {"type": "integer", "minimum": 1},
                            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                            "tools": {"type": "array", "items": {"type": "object"}},
                            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
                            "parallel_tool_calls": {"type": "boolean"}, "text": {"type": "object"},
                            "metadata": {"type": "object"}}}
_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
EMBEDDINGS = {"type": "object", "required": ["model", "input"],
              "properties": {"model": {"type": "string"},
                             "input": {"oneOf": [{"type": "string", "minLength": 1},
                                                 {"type": "array", "minItems": 1, "maxItems": 2048,
                                                  "items": {"type": "string", "minLength": 1}},
                                                 _TOKENS,
                                                 {"type": "array", "minItems": 1, "maxItems": 2048,
                                                  "items": _TOKENS}]},
                             "encoding_format": {"type": "string", "enum": ["float", "base64"]},
                             "dimensions": {"type": "integer", "minimum": 1},
                             "user": {"type": "string"}}}

# The inference answers: 503 is documented (no member / engine can take the request now, with Retry-After);
# 504 is the request timeout. Nothing else in 5xx.
INFERENCE_ERRORS = ("400", "401", "404", "413", "429", "503", "504")


def post(summary: str, schema: dict[str, Any], errors: tuple[str, ...] = INFERENCE_ERRORS,
         parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        **({"parameters": parameters} if parameters else {}),
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "OK (JSON, or server-sent events when stream is true)"},
                      **{code: ERROR for code in errors}},
    }}


def get(summary: str, errors: tuple[str, ...] = ("404",), parameters: list[dict[str, Any]] | None = None
        ) -> dict[str, Any]:
    return {"get": {"summary": summary, **({"parameters": parameters} if parameters else {}),
                    "responses": {"200": {"description": "OK"}, **{code: ERROR for code in errors}}}}


def model_path(summary: str) -> dict[str, Any]:
    return get(summary, parameters=[{"name": "model_id", "in": "path", "required": True,
                                     "schema": {"type": "string"}}])


def document(title: str, paths: dict[str, Any], security_description: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document with bearer-key security and the Error schema."""
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "security": [{"apiKey": []}],
        "components": {"securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                                      "description": security_description}},
                       "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {
                           "error": {"type": "object", "required": ["message", "type"], "properties": {
                               "message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}},
    }
