"""What one request used, from what actually happened: the member's figures when it gave them, else what
the gateway itself saw stream past. Pure: no I/O, no clock.

The rules (docs/accounting.md, "How usage is counted"):

1. The member's final usage, once received, is the request's usage, whatever the client does after it
   (closes its socket right after ``[DONE]``, or before the last write lands): ``source = "member"``.
2. Our engine answers a cancel with a final ``abort`` chunk that carries its own count of the work done up
   to the cut: ``source = "engine"``.
3. Otherwise (an HTTP member's stream cut short, an engine lost mid-answer, an abort report that never
   came) the gateway bills what it saw: the prompt as the member admitted it (our engines say so in their
   acceptance chunk; an HTTP member's usage, where it sent one) or else the gateway's own estimate of the
   prompt, and one output token per streamed token (bus chunks list their token ids; an SSE event with
   content counts its logprobs entries when it has them, else one): ``source = "counted_by_gateway"``.
   What the member generated after the last event the gateway read is not seen (at most the events in
   flight at the cut).
4. Nothing accepted, nothing streamed: zero tokens, ``source = "none"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proto import Usage
from services.common.openai_api import combined_usage

UsageSource = Literal["member", "engine", "counted_by_gateway", "none"]


@dataclass
class UsageMeter:
    """Fed as the answer streams; :meth:`result` says what to bill. ``prompt_tokens_estimate`` is the
    gateway's own guess (characters / 4), used only when the member never said how long the prompt was."""

    prompt_tokens_estimate: int = 0
    admitted: bool = False  # a member accepted the request (the prompt was taken in)
    prompt_tokens: int | None = None  # as the member counted them (acceptance chunk, or a usage it sent)
    cached_tokens: int = 0
    output_tokens_seen: int = 0
    latest_usage: Usage | None = None  # the newest usage the member sent (continuous usage: every chunk)
    final: Usage | None = None
    final_source: UsageSource = "member"
    # n > 1: the choices the member will send (its acceptance says), and the final usage of each that ended
    num_choices: int = 1
    choice_finals: dict[int, tuple[Usage, UsageSource]] = field(default_factory=dict)

    def accepted(self, prompt_tokens: int | None = None, cached_tokens: int = 0) -> None:
        """A member took the request; ``prompt_tokens`` as it counted them, when it said."""
        self.admitted = True
        if prompt_tokens is not None:
            self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens

    def saw_tokens(self, n: int) -> None:
        self.admitted = True
        self.output_tokens_seen += max(0, n)

    def saw_usage(self, usage: Usage) -> None:
        """A usage the member sent before its end (e.g. vLLM's ``continuous_usage_stats``)."""
        self.admitted = True
        self.latest_usage = usage
        self.prompt_tokens, self.cached_tokens = usage.prompt_tokens, usage.cached_tokens

    def finished(self, usage: Usage, source: UsageSource = "member") -> None:
        """The member's final usage (rule 1), or our engine's count at an abort (rule 2)."""
        self.admitted = True
        self.final, self.final_source = usage, source

    def choice_finished(self, choice: int, usage: Usage, source: UsageSource = "member") -> None:
        """One choice's final usage (or our engine's count at its abort). Once every choice has ended, their
        sum is the request's usage (:meth:`finished`): the prompt counted once, the choices' output summed
        (``openai_api.combined_usage``, as the client's own usage says)."""
        self.admitted = True
        self.choice_finals[choice] = (usage, source)
        if len(self.choice_finals) >= self.num_choices:
            ordered = [self.choice_finals[i] for i in sorted(self.choice_finals)]
            self.finished(combined_usage([u for u, _ in ordered]),
                          "engine" if any(src == "engine" for _, src in ordered) else "member")

    @property
    def is_final(self) -> bool:
        return self.final is not None

    def result(self) -> tuple[Usage, UsageSource]:
        if self.final is not None:
            return self.final, self.final_source
        if not self.admitted:
            return Usage(prompt_tokens=0, completion_tokens=0), "none"
        prompt = self.prompt_tokens if self.prompt_tokens is not None else self.prompt_tokens_estimate
        output = self.output_tokens_seen
        if self.latest_usage is not None:  # the member's running count is at least as good as ours
            output = max(output, self.latest_usage.completion_tokens)
        return Usage(prompt_tokens=prompt, completion_tokens=output, cached_tokens=self.cached_tokens), \
            "counted_by_gateway"
