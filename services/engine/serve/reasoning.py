"""A thinking model's reply split into reasoning and answer text, as vLLM's ``qwen3`` / ``deepseek_r1``
reasoning parsers do: the ``<think>…</think>`` block is the reasoning (tags removed), the rest the content.

Pure: text in, text out, one :class:`ReasoningSplitter` per reply. It is fed the reply's text as it is
generated; a tail that may be the start of a tag is held back until it is known, so the pieces streamed
add up to what the whole text gives. Rules:

- ``starts_inside`` (the prompt ended inside an open ``<think>``, as DeepSeek-R1's and Qwen3-Thinking's
  templates leave it): everything up to ``</think>`` is reasoning.
- Otherwise a reply that opens with ``<think>`` (leading whitespace allowed) starts a block; one that
  opens with anything else has no reasoning (all content, a later ``<think>`` included).
- Only the first block is reasoning. A block that never closes (cut by ``max_tokens``) stays reasoning.
- The blank lines after ``</think>`` are dropped from the content.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, *, starts_inside: bool) -> None:
        self._inside = starts_inside
        self._opened = starts_inside  # the reply's start is decided (inside a block, or content only)
        self._done = False  # the block closed, or there is none: the rest is content
        self._held = ""
        self._strip_blank_lines = False  # right after </think>: until the content's first character

    def push(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the new ``text`` (either may be empty)."""
        self._held += text
        reasoning, content = "", ""
        if not self._opened:
            stripped = self._held.lstrip()
            if stripped.startswith(THINK_START):
                self._held = stripped[len(THINK_START):]
                self._opened = self._inside = True
            elif not THINK_START.startswith(stripped):  # not (a start of) the tag: no reasoning
                self._opened, self._done = True, True
            else:
                return "", ""  # whitespace or a start of <think> so far
        if self._inside:
            end = self._held.find(THINK_END)
            if end < 0:
                keep = _partial_suffix(self._held, THINK_END)
                reasoning, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                return reasoning, ""
            reasoning, self._held = self._held[:end], self._held[end + len(THINK_END):]
            self._inside, self._done, self._strip_blank_lines = False, True, True
        if self._done:
            content, self._held = self._content(self._held), ""
        return reasoning, content

    def _content(self, text: str) -> str:
        if self._strip_blank_lines:
            text = text.lstrip("\n")
            self._strip_blank_lines = not text
        return text

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the reply ended."""
        held, self._held = self._held, ""
        if self._inside:
            return held, ""
        if not self._opened:  # only whitespace or a start of <think>: that is the content
            self._opened = self._done = True
        return "", self._content(held)


def split_reasoning(text: str, *, starts_inside: bool) -> tuple[str, str]:
    """A whole reply's ``(reasoning, content)``."""
    splitter = ReasoningSplitter(starts_inside=starts_inside)
    reasoning, content = splitter.push(text)
    r2, c2 = splitter.finish()
    return reasoning + r2, content + c2
