"""Embeddings on the engine: one :class:`~proto.EmbedRequest` → one :class:`~proto.EmbedReply`, for both
faces (the HTTP ``/v1/embeddings`` and the bus ``llm.v1.embed.<worker_id>``).

Texts are tokenized as a completion prompt is (the tokenizer's own special tokens, no chat template);
token-id inputs are taken as they are. The core pools and normalises (model/pooler.py, ``--pooling``).
Errors come back as the reply's ``error`` (OpenAI fields, ``param`` naming ``input``/``dimensions``).
"""

from __future__ import annotations

import msgspec

from proto import EmbedReply, EmbedRequest, ErrorInfo, Usage
from services.engine.errors import EngineError
from services.engine.serve.async_engine import EngineHandle
from services.engine.serve.frontend import encode_prompt, error_info


def _refusal(req: EmbedRequest, info: ErrorInfo, worker_id: str) -> EmbedReply:
    return EmbedReply(request_id=req.request_id, error=info, worker_id=worker_id)


async def embed_reply(engine: EngineHandle, req: EmbedRequest, worker_id: str) -> EmbedReply:
    """Embed ``req``'s inputs; every refusal (bad input, too long, no room, unsupported dimensions) is a reply."""
    core = engine.core
    if req.model != core.model_id:
        return _refusal(req, ErrorInfo(message=f"model '{req.model}' does not exist (this engine serves "
                                               f"'{core.model_id}')", type="invalid_request_error",
                                       code="model_not_found", param="model", status=404), worker_id)
    if bool(req.texts) == bool(req.token_ids):
        return _refusal(req, ErrorInfo(message="give exactly one of texts and token_ids", param="input",
                                       type="invalid_request_error", status=400), worker_id)
    try:
        inputs = [encode_prompt(core, text) for text in req.texts] if req.texts else req.token_ids
        vectors = await engine.embed(req.request_id, inputs)
    except (EngineError, ValueError) as exc:
        info = error_info(exc)
        if info.param in ("messages", "prompt"):
            info = msgspec.structs.replace(info, param="input")
        return _refusal(req, info, worker_id)
    hidden_size = len(vectors[0]) // 4 if vectors else 0
    if req.dimensions is not None and req.dimensions != hidden_size:
        return _refusal(req, ErrorInfo(
            message=f"this model does not support 'dimensions' other than its hidden size {hidden_size} "
                    f"(it was not trained for truncated, matryoshka, embeddings)",
            type="invalid_request_error", code="invalid_parameter", param="dimensions", status=400), worker_id)
    num_tokens = sum(len(ids) for ids in inputs)
    return EmbedReply(request_id=req.request_id, embeddings=vectors, worker_id=worker_id,
                      usage=Usage(prompt_tokens=num_tokens, completion_tokens=0))
