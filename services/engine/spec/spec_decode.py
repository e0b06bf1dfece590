"""Speculative decoding: its settings, the n-gram (prompt-lookup) proposer, and its counters.

A speculative step proposes ``K`` draft tokens to follow a request's sequence, and the target model
verifies them in one forward over ``1 + K`` positions (the last sampled token and the drafts) through the
paged KV cache. Verification (:mod:`rejection_sampler`) keeps the longest run the target agrees with
and then samples one more token itself, so every step still yields at least one token and the output
distribution is exactly the target's (greedy: token for token; sampled: by rejection sampling). Who does
what:

* :class:`SpecConfig`: the method and ``K``, validated once at start;
* proposers: :func:`propose_ngram` here (no weights), ``draft_model.DraftModelProposer`` (a smaller
  checkpoint with the same vocabulary), ``mtp_proposer.MTPProposer`` (the checkpoint's own ``mtp.*``
  module; a checkpoint without one is refused at start, see :func:`check_mtp`);
* the scheduler plans the ``1 + K`` positions and rolls rejected ones back (``scheduler.py``);
* :class:`SpecDecodeCounters`: what /usage, /metrics and the final chunk's timings report, with vLLM's
  meanings (``num_drafts``: verifications with at least one draft token; ``num_accepted_tokens``:
  accepted *draft* tokens, the token sampled by the target itself not included; position ``i`` counts
  drafts whose ``i``-th token was accepted).

Pure: no clock, no I/O except :func:`check_mtp` reading a checkpoint's tensor names at start.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.engine.errors import ModelLoadError, SpeculativeDecodingError
from services.engine.model.loader import checkpoint_tensor_names

SpecMethod = Literal["none", "ngram", "draft", "mtp"]
SPEC_METHODS: tuple[SpecMethod, ...] = ("none", "ngram", "draft", "mtp")
MIN_DRAFT_TOKENS = 1
MAX_DRAFT_TOKENS = 15
DEFAULT_DRAFT_TOKENS = 4


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How (and whether) the engine speculates.

    - ``method``: "none"; "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence
      of the sequence's last ``ngram_max`` .. ``ngram_min`` tokens); "draft" (``draft_model_path``, a
      smaller checkpoint with the target's vocabulary); "mtp" (the checkpoint's own MTP module, ``mtp.*``
      tensors, run recursively for ``K > 1``; see ``mtp_head``).
    - ``num_draft_tokens``: ``K``, draft tokens per step, 1..15.
    - ``lm_head_draft``: the draft logits come from the *target's* LM head. With "draft": applied to the
      draft model's final hidden state (its own head is not used; hidden sizes must match). With "mtp":
      what always happens, since the MTP layout has no head of its own (it shares the main embedding and
      LM head), so the flag is accepted and changes nothing. With "ngram", which has no logits, refused.
    """

    method: SpecMethod = "none"
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    draft_model_path: Path | None = None
    lm_head_draft: bool = False
    ngram_max: int = 3
    ngram_min: int = 1

    @property
    def is_enabled(self) -> bool:
        return self.method != "none"

    def validate(self) -> SpecConfig:
        """Check the combination; return ``self``. Raises SpeculativeDecodingError naming the problem."""
        if self.method not in SPEC_METHODS:
            raise SpeculativeDecodingError(f"unknown method {self.method!r} (expected one of {SPEC_METHODS})")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not MIN_DRAFT_TOKENS <= k <= MAX_DRAFT_TOKENS:
            raise SpeculativeDecodingError(
                f"draft tokens must be an integer in {MIN_DRAFT_TOKENS}..{MAX_DRAFT_TOKENS}, got {k!r}"
            )
        if self.method == "draft" and self.draft_model_path is None:
            raise SpeculativeDecodingError("--spec draft needs --draft-model PATH (a smaller checkpoint with "
                                           "the same tokenizer)")
        if self.method != "draft" and self.draft_model_path is not None:
            raise SpeculativeDecodingError(f"a draft model is only used with --spec draft, not {self.method!r}")
        if self.lm_head_draft and self.method == "ngram":
            raise SpeculativeDecodingError("--lm-head-draft needs a model drafter (--spec draft or mtp): "
                                           "n-gram drafts have no logits to compute")
        if self.lm_head_draft and self.method == "none":
            raise SpeculativeDecodingError("--lm-head-draft needs --spec draft or --spec mtp")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpeculativeDecodingError(
                f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}"
            )
        return self


_DEEPSEEK_MTP = re.compile(r"model\.layers\.\d+\.eh_proj\.weight$")  # DeepSeek-V3's MTP layer (see loader)


def check_mtp(model_path: Path) -> None:
    """Refuse ``--spec mtp`` at start, with the alternatives, when the checkpoint has no ``mtp.*`` tensors.
    (A checkpoint that has some but not the whole module fails in the loader, naming the missing tensor.)"""
    try:
        names = checkpoint_tensor_names(model_path)
    except ModelLoadError:
        return  # the model load that follows reports the broken checkpoint itself
    if not any(n.startswith("mtp.") or _DEEPSEEK_MTP.match(n) for n in names):
        raise SpeculativeDecodingError(
            f"{model_path} has no MTP weights (mtp.* tensors, or DeepSeek-style model.layers.<N>.eh_proj); "
            "use --spec ngram or --spec draft --draft-model PATH"
        )


def propose_ngram(token_ids: Sequence[int], num_tokens: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: for ``n`` from ``max_n`` down to ``min_n``, find the latest earlier occurrence of the
    last ``n`` tokens of ``token_ids`` and propose the ``num_tokens`` tokens that followed it (continuing
    periodically past the end of the sequence); the first ``n`` that matches wins. ``[]`` when nothing
    matches.

    The search is ``bytes.rfind`` over the int64 encoding (C speed: the context is re-encoded every
    step, O(length) bytes, instead of a Python loop over it); a hit at an offset that is not a multiple
    of 8 straddles two tokens and is skipped.
    """
    length = len(token_ids)
    if num_tokens <= 0 or length < 2:
        return []
    data = array("q", token_ids).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * 8 :]
        # The occurrence must end before the last token, so at least one token follows it.
        end = (length - 1) * 8
        at = data.rfind(pattern, 0, end)
        while at != -1 and at % 8:
            at = data.rfind(pattern, 0, at + len(pattern) - 1)
        if at != -1:
            # Copy what followed the match; where that runs into the end of the sequence (a match a short
            # period back, e.g. inside a loop), keep copying from the proposal itself, as LZ77 copies an
            # overlapping match: the period repeats.
            follow = at // 8 + n
            out = list(token_ids[follow : follow + num_tokens])
            while len(out) < num_tokens:
                out.append(out[len(out) - (length - follow)])
            return out
    return []


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Totals since start (see the module docstring for the meaning of each count)."""

    method: str
    num_spec_tokens: int  # K
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]  # length K

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens; 0.0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step, the target's own token included (1 + accepted / drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SpecDecodeCounters:
    """The engine's running counts; :meth:`snapshot` freezes them for telemetry."""

    method: str
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification: ``num_draft_tokens`` proposed, the first ``num_accepted`` of them accepted."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            method=self.method, num_spec_tokens=self.num_spec_tokens, num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(self.accepted_per_pos),
        )
