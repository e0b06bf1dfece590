"""Per-request sampling parameters: what to generate and when to stop.

A frozen value built once at the edge (the service decodes a ``GenerateRequest`` into it) and then
trusted inside the engine. ``validate()`` is the edge check; it raises
:class:`~services.engine.errors.InvalidParameterError` naming the offending field, so the shell can
answer 400 with ``param`` set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.errors import InvalidParameterError

# The engine's cap on top logprobs per token: bounds the per-step host transfer. Equal to OpenAI's cap
# (services/common/openai_api.py), which the HTTP dialect checks before a request gets here.
MAX_LOGPROBS = 20

# torch.Generator.manual_seed accepts the unsigned 64-bit range.
_MAX_SEED = 2**64 - 1

# "tool_call" / "tool_calls": a forced tool call (one / one or more ``<tool_call>`` blocks), spec from
# ``tool_prompt.tool_call_schema``; never on the wire (the engine derives it from the request's tool_choice)
# "json_tool_call" / "json_tool_calls": the same in Llama 3's form (the reply is the call JSON, several
# separated by "; ")
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call", "tool_calls",
                    "json_tool_call", "json_tool_calls")


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutput:
    """What a constrained request's text must match (see ``proto.Constraint``; ``model/grammar.py`` compiles
    it). Hashable: it is the grammar cache's key, with the tokenizer the cache belongs to."""

    kind: str
    spec: str = ""
    strict: bool = False
    choices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ThinkingParams:
    """How the core follows a reply's ``<think>`` block, token by token (the tags are single tokens).

    ``starts_inside``: the prompt opened the block (the reply starts in reasoning); otherwise a
    ``start_id`` token opens it. ``end_id`` closes it. ``budget_tokens`` (None: no limit): once that many
    tokens were spent in the block, the next tokens are forced to ``end_ids`` (``end_id`` first, e.g.
    ``</think>`` and a blank line) and the reply goes on with the answer."""

    start_id: int
    end_id: int
    starts_inside: bool = False
    budget_tokens: int | None = None
    end_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request samples and stops.

    - ``max_tokens``: output tokens to generate at most (>= 1); reaching it finishes with ``"length"``.
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it before softmax.
    - ``top_p``: nucleus mass in (0, 1]; 1 disables it. The smallest set of most-likely tokens whose
      cumulative probability reaches ``top_p`` is kept (always at least one token).
    - ``top_k``: keep the ``k`` most likely tokens; 0 or -1 disables it.
    - ``seed``: when set, the request draws from its own ``torch.Generator`` seeded with it, so the
      same request gives the same tokens whatever else shares its batch.
    - ``stop``: stop strings, matched on detokenized text by the caller (see ``stop_checker.py``);
      the matched string is not emitted.
    - ``stop_token_ids``: token ids that finish the request with ``"stop"`` (even with ``ignore_eos``).
    - ``ignore_eos``: do not stop on the model's end-of-sequence tokens.
    - ``logprobs``: return the top-n log-probabilities per output token (0..20), or None for none.
    - ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, -2..2): subtracted from the logit of every
      token already in the output, once / once per occurrence. ``repetition_penalty`` (> 0, 1 is off;
      the CTRL / vLLM one): logits of tokens in the prompt or the output are divided by it when positive
      and multiplied by it when negative. Applied before temperature, top-k and top-p, in that order
      (as vLLM does); logprobs stay the model's own distribution.
    - ``min_tokens`` (vLLM's): until this many tokens are out, the stop token ids and the model's EOS
      cannot be sampled and stop strings do not end the reply (0: off; at most ``max_tokens``).
    - ``structured``: constrained decoding (a grammar masks the logits each step), or None.
    - ``min_p`` (vLLM's, [0, 1]): tokens whose probability is below ``min_p`` times the top token's are
      dropped (after temperature, with top-k/top-p). 0 is off.
    - ``logit_bias`` (OpenAI's): ``(token_id, bias)`` pairs added to the logits (-100..100) before anything
      else; -100 bans a token in practice, +100 makes it all but certain.

    Sequences given for ``stop``/``stop_token_ids`` are stored as tuples so the value stays hashable.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # a thinking model's reply: reasoning tokens counted, and a budget forced (None: no thinking to follow)
    thinking: ThinkingParams | None = None

    def __post_init__(self) -> None:
        # Callers naturally pass lists (JSON arrays); freeze them so the dataclass stays immutable.
        if not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", _as_tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def shapes_logits(self) -> bool:
        """Its logits depend on its own history (penalties, min_tokens): sampled with that history, and
        not speculated (verification compares drafts against the plain target rows)."""
        return self.has_penalties or self.min_tokens > 0

    @property
    def can_speculate(self) -> bool:
        """Drafts are verified against plain target rows; rows whose logits are reshaped per request
        (penalties, min_tokens, logit_bias, a grammar's mask) are decoded one token a step instead."""
        return (not self.shapes_logits and self.structured is None and not self.logit_bias
                and (self.thinking is None or self.thinking.budget_tokens is None))  # a budget forces tokens

    @property
    def effective_top_k(self) -> int:
        """``top_k`` with both "off" spellings (0 and -1) normalised to 0."""
        return self.top_k if self.top_k > 0 else 0

    def validate(self) -> SamplingParams:
        """Check every field's range; return ``self`` so it chains. Raises InvalidParameterError."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParameterError("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not _is_real(self.temperature) or not (0.0 <= self.temperature < float("inf")):
            raise InvalidParameterError("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidParameterError("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParameterError("top_k", self.top_k, "must be -1, 0 (off) or a positive integer")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= _MAX_SEED)):
            raise InvalidParameterError("seed", self.seed, f"must be an integer in [0, {_MAX_SEED}]")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidParameterError("stop", s, "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise InvalidParameterError("stop_token_ids", t, "token ids must be integers >= 0")
        n = self.logprobs
        if n is not None and (not _is_int(n) or not (0 <= n <= MAX_LOGPROBS)):
            raise InvalidParameterError("logprobs", n, f"must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise InvalidParameterError(name, value, "must be a number in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidParameterError("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParameterError("min_tokens", self.min_tokens, "must be an integer in [0, max_tokens]")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError("min_p", self.min_p, "must be a number in [0, 1]")
        for token_id, bias in self.logit_bias:
            if not _is_int(token_id) or token_id < 0:
                raise InvalidParameterError("logit_bias", token_id, "keys must be token ids (integers >= 0)")
            if not _is_real(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidParameterError("logit_bias", bias, "biases must be numbers in [-100, 100]")
        if self.structured is not None and self.structured.kind not in CONSTRAINT_KINDS:
            raise InvalidParameterError("response_format", self.structured.kind,
                                        f"must be one of {', '.join(CONSTRAINT_KINDS)}")
        return self


def _as_tuple(value: Any) -> tuple[Any, ...]:
    # A bare string is one stop string, not a sequence of one-character stops.
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
