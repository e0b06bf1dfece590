"""One generation request as the scheduler sees it.

``Request`` is mutable and owned by the scheduler (one thread, the engine's step loop); everyone else
reads it. Its token sequence is ``prompt_token_ids + output_token_ids``; ``num_computed_tokens`` of them
have KV in the cache. Times are plain floats in seconds passed in by the caller (the scheduler never
reads a clock), all from the same monotonic clock as ``arrival_s``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from services.engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life. The ``FINISHED_*`` states are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    # Lost its KV blocks to an older request; waits at the front of the queue to be recomputed.
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a terminal status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
_FINISHED = frozenset(_FINISH_REASONS)


class Request:
    """A request's tokens, progress and bookkeeping.

    Writers: the scheduler (status, ``num_computed_tokens``, output tokens, timings,
    ``num_cached_prompt_tokens``, ``num_preemptions``), the engine core (``last_token_s``) and the block
    pool (``block_ids``, the physical KV blocks backing the sequence in order). Telemetry reads and resets
    ``num_new_output_tokens_since_sample`` via :meth:`take_new_output_tokens`.

    Speculative decoding: the engine core writes ``spec_token_ids`` (draft tokens proposed to follow
    the sequence, to be verified in the next step; the scheduler consumes them when it schedules the
    request and drops them on preemption) and the per-request counters ``num_draft_tokens`` /
    ``num_accepted_draft_tokens``. Draft tokens are never part of ``all_token_ids`` until verified.
    """

    __slots__ = (
        "_all_token_ids",
        "arrival_s",
        "block_ids",
        "eos_token_ids",
        "finished_s",
        "first_scheduled_s",
        "first_token_s",
        "last_token_s",
        "num_accepted_draft_tokens",
        "num_cached_prompt_tokens",
        "num_computed_tokens",
        "num_draft_tokens",
        "num_new_output_tokens_since_sample",
        "num_preemptions",
        "num_prompt_tokens",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: SamplingParams,
        arrival_s: float,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        # One list for prompt + output so slicing a chunk and hashing a block never concatenates.
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self._all_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # Set once, on first admission: prompt tokens served from the prefix cache (0 with caching off).
        self.num_cached_prompt_tokens: int | None = None
        self.num_preemptions = 0
        self.num_new_output_tokens_since_sample = 0
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.arrival_s = arrival_s
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        # When the engine core last emitted tokens of this request (its inter-token gaps are measured from it).
        self.last_token_s: float | None = None
        self.finished_s: float | None = None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids)})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's token ids."""
        return self._all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated token ids so far (a stop token, when one ended it, is included)."""
        return self._all_token_ids[self.num_prompt_tokens :]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids. The live list, not a copy: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Length of prompt + output."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" once finished, else None."""
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token (the only way output grows)."""
        self._all_token_ids.append(token_id)
        self.num_new_output_tokens_since_sample += 1

    def take_new_output_tokens(self) -> int:
        """Return the output tokens produced since the last call and reset the counter (telemetry)."""
        n = self.num_new_output_tokens_since_sample
        self.num_new_output_tokens_since_sample = 0
        return n
