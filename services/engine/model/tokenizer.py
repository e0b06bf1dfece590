"""Tokenizer: text ⇄ token ids, chat templating, and streaming detokenization for one model directory.

Reads ``tokenizer.json`` (the fast-tokenizer file, via the ``tokenizers`` library), ``tokenizer_config.json``
(special-token strings and ``chat_template``; a ``chat_template.jinja`` file is used when the config has no
template) and, if present, ``generation_config.json`` (extra stop ids).

Chat templates are rendered the way transformers renders them, so a checkpoint's template means the same
here: a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text, and the globals ``raise_exception`` and
``strftime_now``. Any failure to compile or render becomes a ChatTemplateError carrying the template's
own message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from services.common.tool_calls import HERMES, LLAMA3_JSON, PYTHON_TAG
from services.engine.errors import ChatTemplateError, ModelLoadError
from services.engine.model.tool_prompt import fold_tools


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte 0..255 is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_UNICODE_TO_BYTE = _byte_level_table()
_THINK_BLOCK = re.compile(r"<think>.*?</think>\n*", re.DOTALL)
# A reply that starts inside reasoning (the generation prompt already opened <think>) has only the closer.
_DANGLING_THINK = re.compile(r"^.*?</think>\n*", re.DOTALL)


def _token_string(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens either as strings or as AddedToken objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's built-in tojson HTML-escapes and sorts keys; templates are written against transformers'.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str, now: Callable[[], datetime] = datetime.now) -> jinja2.Template:
    """Compile a chat template as transformers does. ``now`` backs ``strftime_now`` (Llama 3.1 templates
    print today's date); it is a parameter so tests can pin it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def strip_thinking(content: Any) -> Any:
    """``content`` with ``<think>…</think>`` blocks (and a leading reasoning run closed by a lone
    ``</think>``) removed; a list of content parts has each text part stripped."""
    if isinstance(content, str):
        return _DANGLING_THINK.sub("", _THINK_BLOCK.sub("", content), count=1)
    if isinstance(content, list):
        return [
            {**part, "text": strip_thinking(part["text"])}
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
    return content


class Tokenizer:
    """One model's tokenizer. Immutable after ``from_dir``; safe to share between threads."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        config: Mapping[str, Any],
        *,
        chat_template: str | None,
        generation_eos_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self.bos_token = _token_string(config.get("bos_token"))
        self.eos_token = _token_string(config.get("eos_token"))
        self.pad_token = _token_string(config.get("pad_token"))
        self.unk_token = _token_string(config.get("unk_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        added = tokenizer.get_added_tokens_decoder()
        self.special_tokens: dict[str, int] = {t.content: i for i, t in sorted(added.items()) if t.special}
        self.special_token_ids = frozenset(self.special_tokens.values())
        stop = [] if self.eos_token_id is None else [self.eos_token_id]
        stop += [i for i in generation_eos_ids if i not in stop]
        # Ids that end generation: the tokenizer's eos plus generation_config.json's (Qwen lists both
        # <|im_end|> and <|endoftext|> there).
        self.stop_token_ids: tuple[int, ...] = tuple(stop)
        self.chat_template_source = chat_template
        self._chat_template = None if chat_template is None else compile_chat_template(chat_template)

    @property
    def tool_call_format(self) -> str:
        """How this model writes tool calls (services/common/tool_calls.py): Llama 3.x's JSON form when its
        template is Llama 3's (it renders tool results as ``ipython`` turns, or knows ``<|python_tag|>``, and
        asks for ``"parameters"``), else the Qwen3 / Hermes ``<tool_call>`` blocks (also what a template that
        ignores tools gets written into its prompt: tool_prompt.py)."""
        source = self.chat_template_source or ""
        if ("ipython" in source or PYTHON_TAG in source) and '"parameters"' in source:
            return LLAMA3_JSON
        return HERMES

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(str(root), "tokenizer.json not found")
        try:
            tokenizer = _HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises bare Exception on malformed files
            raise ModelLoadError(str(tokenizer_file), f"cannot parse tokenizer.json: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json") or {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        generation = _read_json(root / "generation_config.json") or {}
        eos = generation.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        return cls(tokenizer, config, chat_template=template, generation_eos_ids=eos_ids)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be smaller than the model's embedding rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` applies the tokenizer's post-processor (e.g. a
        Llama BOS); pass False for rendered chat prompts, whose template already wrote those tokens."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (what logprobs report): byte-level BPE pieces (GPT-2 / Llama 3 /
        Qwen) mapped back through the byte-to-character table, SentencePiece byte-fallback pieces
        (``<0x0A>``) as their byte, ``▁`` as a space; special tokens as their text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_token_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            try:
                return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
            except KeyError:  # an added (non-special) token stored as plain text
                return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        preserve_thinking: bool = False,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (OpenAI-style dicts with ``role`` and ``content``) into a prompt string.

        Unless ``preserve_thinking``, assistant turns before the last user turn lose their
        ``<think>…</think>`` blocks and any ``reasoning_content``: finished exchanges' reasoning is not
        replayed to the model (the rule Qwen3's own template applies). Assistant turns after the last user
        turn (an agent's tool loop in progress, or a reply being continued) keep theirs.
        ``template_kwargs`` reach the template as variables (e.g. ``enable_thinking=False``).
        ``tools`` (transformers' shape: ``{"type": "function", "function": {...}}``) reach the template as
        ``tools``; a template that renders the same with and without them gets them, and the messages'
        ``tool_calls`` / ``tool`` turns, in the Hermes / Qwen3 form instead (``tool_prompt.py``).
        """
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        prepared = [dict(m) for m in messages]
        if "developer" not in (self.chat_template_source or ""):
            prepared = developer_as_system(prepared)
        if not preserve_thinking:
            last_user = max((i for i, m in enumerate(prepared) if m.get("role") == "user"), default=-1)
            for message in prepared[:last_user]:
                if message.get("role") == "assistant":
                    message["content"] = strip_thinking(message.get("content"))
                    message.pop("reasoning_content", None)
        if "reasoning_content" not in (self.chat_template_source or ""):
            # a template that does not read reasoning_content would drop it: it goes in as the <think>
            # block the model wrote (Qwen3's own template reads the field, and finds such blocks in content)
            for message in prepared:
                reasoning = message.pop("reasoning_content", None)
                if message.get("role") == "assistant" and isinstance(reasoning, str) and reasoning:
                    content = message.get("content")
                    message["content"] = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n" + _text(content)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **template_kwargs,
            "messages": prepared,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            if tools:
                with_tools = self._chat_template.render(**variables, tools=list(tools))
                if with_tools != self._chat_template.render(**variables):
                    return with_tools
            # The template ignores tools (or got none): calls and results it cannot write go in as text.
            source = self.chat_template_source or ""
            if tools or (any(m.get("tool_calls") or m.get("role") == "tool" for m in prepared)
                         and "tool_calls" not in source):
                variables["messages"] = fold_tools(prepared, tools)
            return self._chat_template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # Templates index messages freely; a malformed message surfaces as a Python error in there.
            raise ChatTemplateError(f"chat template failed on these messages: {exc!r}") from exc


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, Mapping))


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role (what o1-era SDKs, the Responses API and coding agents such as Codex send in
    place of ``system``) as ``system`` for a template that does not know it: Qwen3's and Llama's templates
    raise on an unknown role or drop the turn silently. The leading system turns are then one turn (their
    texts joined by a blank line): many templates accept one system turn, first (llama.cpp maps the role
    the same way, ggml-org/llama.cpp#20215). A later system turn is left where it is, for the template to
    judge."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    out = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    lead = 0
    while lead < len(out) and out[lead].get("role") == "system":
        lead += 1
    if lead > 1:
        merged = {**out[0], "content": "\n\n".join(t for t in (_text(m.get("content")) for m in out[:lead]) if t)}
        out = [merged, *out[lead:]]
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(str(path), f"invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(str(path), "not a JSON object")
    return data


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation is the decoded text.

    A byte-level token can end in the middle of a UTF-8 character; decoding then yields U+FFFD. So text
    is emitted only when the decoding of the recent window is *stable*: it grew and does not end in
    U+FFFD. The window (``prefix_offset`` .. end) is re-decoded with a few tokens of left context because
    some decoders (SentencePiece's leading-space rule) render a token differently at the start of a
    string. ``flush`` emits whatever is held back once the stream ends (including a genuine trailing
    U+FFFD, which is indistinguishable from an unfinished character until then).
    """

    def __init__(
        self, tokenizer: Tokenizer, *, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        # Five tokens of prompt as left context, as vLLM does; none of the prompt is emitted.
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - 5, 0)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: int | Sequence[int]) -> str:
        """Add one or more generated ids; return the newly stable text ("" while a character is split)."""
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit any text still held back; call once when generation ends."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
