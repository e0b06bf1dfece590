"""A request's choices: ``n``, ``echo`` and ``suffix`` (issue #26), the same on both faces (``http.py``,
``worker.py``), on top of :mod:`frontend`.

- ``n`` choices: choice 0 is admitted alone; once its first output is out (its prompt prefilled, the
  prompt's full blocks in the prefix cache) choices 1..n-1 are admitted and find those blocks, so the
  prompt is computed once. Choice i samples with ``seed + i`` (unseeded choices draw independently). The
  engine sees them as requests ``<request_id>-<i>`` (one choice: ``<request_id>``).
- ``echo`` (completions): each choice's text starts with the prompt, one chunk per choice just before the
  first generated output (so a gateway still sees "first token" only once the engine produced one).
- ``suffix`` (completions): the prompt becomes a fill-in-the-middle prompt with the tokenizer's FIM tokens
  (Qwen2.5-Coder / StarCoder style); without such tokens it is a 400 that says so.

Every chunk carries its choice (``TokenChunk.choice``); each choice ends with its own final chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import msgspec

from proto import GenerateRequest, TokenChunk
from services.engine.core.sampling_params import SamplingParams
from services.engine.errors import InvalidParameterError, UnsupportedParameterError
from services.engine.model.tokenizer import Tokenizer
from services.engine.outputs import RequestOutput
from services.engine.serve.async_engine import EngineHandle, RequestStream
from services.engine.serve.frontend import PromptEncoder, output_chunk, prepare_request, reasoning_splitter

# Fill-in-the-middle token triples (prefix, suffix, middle): Qwen2.5-Coder's, then StarCoder's.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


def fill_in_the_middle(tokenizer: Tokenizer, model_id: str, prompt: str, suffix: str) -> str:
    """The FIM prompt for ``prompt`` + hole + ``suffix``; raises :class:`UnsupportedParameterError` when the
    tokenizer has no fill-in-the-middle tokens."""
    for start, hole, middle in FIM_TOKENS:
        if all(tokenizer.token_to_id(t) is not None for t in (start, hole, middle)):
            return f"{start}{prompt}{hole}{suffix}{middle}"
    raise UnsupportedParameterError("suffix", f"'suffix' needs fill-in-the-middle tokens (<|fim_prefix|>, "
                                              f"<|fim_suffix|>, <|fim_middle|>) and model '{model_id}' has none")


def prepare_choices(core: PromptEncoder, req: GenerateRequest) -> tuple[list[int], list[SamplingParams]]:
    """Prompt token ids and each choice's sampling params (:func:`frontend.prepare_request` with ``n``,
    ``echo`` and ``suffix`` applied); raises the engine's typed errors (400s)."""
    if req.n < 1 or req.n > core.config.max_concurrency:
        raise InvalidParameterError("n", req.n, f"more than this engine's max concurrency "
                                                f"({core.config.max_concurrency}): the choices decode side by side")
    if req.echo and req.logprobs is not None:
        raise UnsupportedParameterError("echo", "'echo' with 'logprobs' needs the prompt's logprobs, which this "
                                                "engine does not compute: send one of the two")
    if req.suffix and req.messages is None:
        req = msgspec.structs.replace(req, prompt=fill_in_the_middle(core.tokenizer, core.model_id, req.prompt or "",
                                                                     req.suffix))
    prompt_ids, params = prepare_request(core, req)
    return prompt_ids, [params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
                        for i in range(req.n)]


def choice_request_id(request_id: str, choice: int, num_choices: int) -> str:
    """The engine's id for one choice of a request."""
    return request_id if num_choices == 1 else f"{request_id}-{choice}"


@dataclass
class Choices:
    """One request's admitted choices: a stream each, and choice 0's first output when it was read at
    admission (n > 1 waits for it; the bus face also reads it against the request's deadline)."""

    request_id: str
    params: list[SamplingParams]
    streams: list[RequestStream]
    first: RequestOutput | None = None

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()  # a reader that went away aborts the choice in the engine (frees its blocks)


async def admit_first(engine: EngineHandle, request_id: str, prompt_ids: Sequence[int],
                      params: list[SamplingParams], source: str) -> Choices:
    """Admit choice 0; raises the engine's admission errors (queue full, context length, ...)."""
    stream = await engine.add_request(choice_request_id(request_id, 0, len(params)), prompt_ids, params[0],
                                      source=source)
    return Choices(request_id, params, [stream])


async def admit_rest(engine: EngineHandle, choices: Choices, prompt_ids: Sequence[int], source: str) -> None:
    """Admit choices 1..n-1 (after choice 0's first output: see the module docstring)."""
    n = choices.num_choices
    for i in range(len(choices.streams), n):
        choices.streams.append(await engine.add_request(choice_request_id(choices.request_id, i, n), prompt_ids,
                                                        choices.params[i], source=source))


async def choice_chunks(tokenizer: Tokenizer, choices: Choices, worker_id: str, echo: str | None,
                        last_index: int = 0) -> AsyncIterator[TokenChunk]:
    """The reply's TokenChunks after the acceptance, numbered on from ``last_index``: the choices' outputs
    interleaved as they come (``choice`` says whose), each choice's echo first."""
    index = last_index
    request_id = choices.request_id
    splitters = [reasoning_splitter(p) for p in choices.params]
    echoed = echo is None

    def chunks_for(i: int, output: RequestOutput) -> list[TokenChunk]:
        nonlocal index, echoed
        out: list[TokenChunk] = []
        if not echoed:
            echoed = True
            for j in range(choices.num_choices):
                index += 1
                out.append(TokenChunk(request_id=request_id, index=index, text=echo or "", choice=j))
        index += 1
        chunk = output_chunk(tokenizer, request_id, index, output, worker_id, splitters[i])
        out.append(chunk if i == 0 else msgspec.structs.replace(chunk, choice=i))
        return out

    if choices.num_choices == 1:
        if choices.first is not None:
            for chunk in chunks_for(0, choices.first):
                yield chunk
        async for output in choices.streams[0]:
            for chunk in chunks_for(0, output):
                yield chunk
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        async for output in choices.streams[i]:
            await queue.put((i, output))
        await queue.put((i, None))

    if choices.first is not None:
        await queue.put((0, choices.first))
    pumps = [asyncio.create_task(pump(i), name=f"{request_id}-{i}") for i in range(len(choices.streams))]
    try:
        num_open = len(pumps)
        while num_open:
            i, item = await queue.get()
            if item is None:
                num_open -= 1
                continue
            for chunk in chunks_for(i, item):
                yield chunk
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
