"""Offline API: ``LLM(model_dir).generate(prompts, sampling)`` runs the engine in the calling thread.

All prompts are queued at once and served with continuous batching, exactly as the service serves
concurrent clients; results come back in prompt order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.engine.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.model.tokenizer import Tokenizer
from services.engine.outputs import RequestTimings


@dataclass(frozen=True)
class Completion:
    num_prompt_tokens: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    num_cached_tokens: int
    timings: RequestTimings | None


class LLM:
    def __init__(self, model_dir: str | Path, **config: Any) -> None:
        """``config``: any :class:`EngineConfig` field (``kv_capacity_tokens``, ``max_concurrency``, …)."""
        self.core = EngineCore(EngineConfig(model_path=Path(model_dir), **config))
        self._next_id = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 ) -> list[Completion]:
        """Generate for every prompt (text, or token ids) and return the completions in prompt order.

        Requests beyond the pending queue's bound are fed in as room frees up, so any number of
        prompts can be given at once.
        """
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        pending: list[tuple[str, list[int], SamplingParams]] = []
        for prompt, p in zip(prompts, params, strict=True):
            token_ids = self.core.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            ids.append(rid)
            pending.append((rid, token_ids, p))
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        done: dict[str, Completion] = {}
        prompt_len = {rid: len(t) for rid, t, _ in pending}
        pending.reverse()
        limit = self.core.config.max_concurrency + self.core.config.max_pending_requests
        in_engine = 0
        while pending or self.core.has_unfinished_requests():
            while pending and in_engine < limit:
                rid, token_ids, p = pending.pop()
                self.core.add_request(rid, token_ids, p, time.monotonic())
                in_engine += 1
            for out in self.core.step(time.monotonic):
                texts[out.request_id].append(out.text)
                tokens[out.request_id].extend(out.token_ids)
                if out.finished:
                    in_engine -= 1
                    done[out.request_id] = Completion(
                        prompt_len[out.request_id], "".join(texts[out.request_id]),
                        tuple(tokens[out.request_id]), out.finish_reason or "", out.num_cached_tokens, out.timings,
                    )
        return [done[rid] for rid in ids]


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    """Greedy sampling params (temperature 0), a convenience for tests and benchmarks."""
    return replace(SamplingParams(temperature=0.0, max_tokens=max_tokens), **kwargs)
