"""The OpenAI ``/v1/embeddings`` dialect both HTTP faces speak (the gateway and ninfer-serve). Pure.

Request (https://platform.openai.com/docs/api-reference/embeddings/create): ``model``; ``input`` as a
string, a list of strings, a list of token ids, or a list of lists of token ids (the four forms the
OpenAI SDK sends); ``encoding_format`` ``float`` (default) or ``base64``; ``dimensions``; ``user``
(informational, as OpenAI treats it). Anything else in the body is listed in ``unsupported``: our engine
refuses it by name (400 ``unsupported_parameter``), so a parameter it does not implement is never
silently ignored.

The answer's vectors travel as little-endian float32 bytes (proto ``EmbedReply``); ``base64`` is those
bytes encoded, which is what the OpenAI SDK decodes (``np.frombuffer(base64.b64decode(s), dtype="float32")``
in openai/resources/embeddings.py), and ``float`` is the same numbers as JSON.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any, Literal

from proto import EmbedReply, EmbedRequest
from services.common.openai_api import MAX_INT, InvalidRequest

EncodingFormat = Literal["float", "base64"]
MAX_INPUTS = 2048  # OpenAI's limit on the number of inputs in one request
KNOWN_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    encoding_format: EncodingFormat
    embed: EmbedRequest  # request_id/gateway fields are filled in by the service
    # Body fields outside OpenAI's (vLLM's truncate_prompt_tokens, ...): ninfer-serve refuses them by name;
    # the gateway sends such a request only to HTTP members, with the body as it came.
    unsupported: tuple[str, ...] = ()


def _token_list(value: list[Any], param: str) -> list[int]:
    if not value:
        raise InvalidRequest(f"'{param}' must not be an empty list", param)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequest(f"'{param}' must hold only integer token ids", param)
        if t < 0 or t > MAX_INT:
            raise InvalidRequest(f"'{param}' holds a token id out of range: {t}", param)
    return list(value)


def parse_embeddings(body: dict[str, Any]) -> EmbeddingsRequest:
    """Validate an embeddings body; raises :class:`InvalidRequest` (a 400 naming ``param``)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", "model")
    if "input" not in body:
        raise InvalidRequest("'input' is required", "input")
    raw = body["input"]
    texts: list[str] = []
    token_ids: list[list[int]] = []
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw:
        if all(isinstance(x, str) for x in raw):
            texts = list(raw)
        elif all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            token_ids = [_token_list(raw, "input")]
        elif all(isinstance(x, list) for x in raw):
            token_ids = [_token_list(x, f"input[{i}]") for i, x in enumerate(raw)]
        else:
            raise InvalidRequest("'input' must be a string, a list of strings, a list of token ids or a list "
                                 "of lists of token ids", "input")
    else:
        raise InvalidRequest("'input' must be a non-empty string, a list of strings, a list of token ids or "
                             "a list of lists of token ids", "input")
    num_inputs = len(texts) or len(token_ids)
    if num_inputs > MAX_INPUTS:
        raise InvalidRequest(f"'input' may hold at most {MAX_INPUTS} inputs, got {num_inputs}", "input")
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequest("'input' must not hold an empty string", "input" if len(texts) == 1 else f"input[{i}]")
    fmt: EncodingFormat
    match body.get("encoding_format"):
        case None | "float":
            fmt = "float"
        case "base64":
            fmt = "base64"
        case _:
            raise InvalidRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                   or not 1 <= dimensions <= MAX_INT):
        raise InvalidRequest("'dimensions' must be a positive integer", "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", "user")
    embed = EmbedRequest(request_id="", model=model, texts=texts, token_ids=token_ids, dimensions=dimensions)
    return EmbeddingsRequest(model=model, encoding_format=fmt, embed=embed,
                             unsupported=tuple(sorted(set(body) - KNOWN_FIELDS)))


def float32_bytes(vector: list[float]) -> bytes:
    """A vector as little-endian float32 bytes (the bus form, and base64's payload)."""
    return struct.pack(f"<{len(vector)}f", *vector)


def floats(data: bytes) -> list[float]:
    """Little-endian float32 bytes back to numbers."""
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def embeddings_body(model: str, reply: EmbedReply, encoding_format: EncodingFormat) -> dict[str, Any]:
    """The OpenAI ``list`` of ``embedding`` objects for a successful reply."""
    data = []
    for i, raw in enumerate(reply.embeddings):
        value: str | list[float] = base64.b64encode(raw).decode("ascii") if encoding_format == "base64" else floats(raw)
        data.append({"object": "embedding", "index": i, "embedding": value})
    prompt_tokens = reply.usage.prompt_tokens if reply.usage is not None else 0
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
