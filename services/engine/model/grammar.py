"""Constrained decoding (structured outputs) with xgrammar: grammars compiled once, token masks per step.

Why xgrammar: it is the library vLLM (default backend), SGLang and TensorRT-LLM use for this; it compiles a
JSON schema, a regex or an EBNF grammar against one tokenizer's vocabulary into a pushdown automaton with a
per-state cache of allowed tokens, and fills a ``[N, ceil(V / 32)]`` int32 bitmask per row on the CPU in
microseconds for most states (docs/openai_api.md has what we measured). Its ``apply_token_bitmask_inplace``
has CPU and CUDA kernels, so the same code masks logits on either device.

Who owns what: :class:`GrammarCache` belongs to the engine core (one per tokenizer, so the cache key is the
constraint alone: kind + text + flags); a :class:`xgrammar.GrammarMatcher` per constrained request lives in
the core's per-request state and follows the request through chunked prefill and preemption (recompute
keeps the request's output tokens, all of which the matcher has accepted, so it is at the right position
when the request resumes; nothing is rolled back). Constrained requests do not speculate
(``SamplingParams.can_speculate``), so the matcher only ever sees tokens that were emitted.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from services.engine.core.sampling_params import StructuredOutput
from services.engine.errors import InvalidParameterError
from services.engine.model.tokenizer import Tokenizer

DEFAULT_MAX_GRAMMARS = 256  # compiled grammars kept (LRU); a JSON schema's grammar is tens of KiB
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


# One JSON string character: anything but a quote, a backslash or a control character, or an escape.
_JSON_CHAR = r'([^"\\\x00-\x1f]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4}))'


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with every ``{"type": "string", "minLength"/"maxLength": ...}`` (no pattern or format)
    rewritten as the same language spelled as a ``pattern``. Why: xgrammar 0.2.9 compiles a length-bounded
    string to ``[^"\\\r\n]{m,n}``, which admits raw control characters (we saw ``\x00`` and ``\x1b``
    inside strings, which strict JSON parsers such as pydantic's refuse); its pattern path does not."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if (out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys()
            and isinstance(out.get("minLength", 0), int) and isinstance(out.get("maxLength", 0), int)):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_JSON_CHAR}{{{lo},{hi}}}$"
    return out


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (vLLM's ``guided_choice``)."""
    # JSON string literals are valid EBNF literals in xgrammar (same escapes: \\" \\\\ \\n \\uXXXX)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def tool_call_grammar(call_schema: str, *, parallel: bool) -> str:
    """EBNF (root rule ``tool_calls_root``) for ``<tool_call>\n<call JSON>\n</tool_call>`` blocks, one, or
    one or more separated by a newline when ``parallel``; the call JSON matches ``call_schema``."""
    schema = json.dumps(bounded_strings_as_patterns(json.loads(call_schema)))
    call_json = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    more = ' ("\\n" tool_call_block)*' if parallel else ""
    return (f"{call_json}\ntool_call_block ::= \"<tool_call>\\n\" root \"\\n</tool_call>\"\n"
            f"tool_calls_root ::= tool_call_block{more}\n")


def json_tool_call_grammar(call_schema: str, *, parallel: bool) -> str:
    """EBNF (root rule ``tool_calls_root``) for Llama 3's calls: the reply is one call JSON matching
    ``call_schema``, or one or more separated by ``"; "`` when ``parallel`` (what vLLM's llama3_json parser
    splits on)."""
    schema = json.dumps(bounded_strings_as_patterns(json.loads(call_schema)))
    call_json = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    more = ' ("; " root)*' if parallel else ""
    return f"{call_json}\ntool_calls_root ::= root{more}\n"


class GrammarCache:
    """Compiles :class:`StructuredOutput` values for one tokenizer and keeps the results (LRU).

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's: the padding ids are
    never allowed). Special tokens are never allowed inside a grammar; the stop ids are allowed where the
    grammar may end. Counters: ``num_hits``, ``num_misses``, ``compile_s_total`` (seconds spent compiling).
    Used from the engine's step thread only.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_grammars: int = DEFAULT_MAX_GRAMMARS) -> None:
        encoded = [b"" if i in tokenizer.special_token_ids else tokenizer.token_bytes(i)
                   for i in range(min(tokenizer.vocab_size, vocab_size))]
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                                       stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._grammars: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._max_grammars = max_grammars
        self.num_hits = 0
        self.num_misses = 0
        self.compile_s_total = 0.0

    def compile(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar (cached). Raises InvalidParameterError for a schema/regex/grammar that
        xgrammar cannot compile, naming the request field."""
        found = self._grammars.get(constraint)
        if found is not None:
            self._grammars.move_to_end(constraint)
            self.num_hits += 1
            return found
        start = time.perf_counter()
        try:
            compiled = self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as these
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first_line = _XGRAMMAR_LOG_PREFIX.sub("", first_line)  # "[14:06:34] /project/cpp/x.cc:12: "
            field = "tools" if "tool_call" in constraint.kind else "response_format"
            raise InvalidParameterError(field, constraint.kind,
                                        f"cannot be compiled into a grammar: {first_line[:300]}") from None
        self.compile_s_total += time.perf_counter() - start
        self.num_misses += 1
        self._grammars[constraint] = compiled
        if len(self._grammars) > self._max_grammars:
            self._grammars.popitem(last=False)
        return compiled

    def _compile(self, c: StructuredOutput) -> xgr.CompiledGrammar:
        if c.kind == "json_schema":
            # any_whitespace=False: the compact form vLLM also asks for; a random or weak model otherwise
            # spends its tokens on whitespace between JSON tokens
            schema = json.dumps(bounded_strings_as_patterns(json.loads(c.spec)))
            return self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=c.strict)
        if c.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.kind == "regex":
            return self._compiler.compile_regex(c.spec)
        if c.kind == "choice":
            if not c.choices:
                raise ValueError("choice needs at least one string")
            return self._compiler.compile_grammar(choice_grammar(c.choices))
        if c.kind == "grammar":
            return self._compiler.compile_grammar(c.spec)
        if c.kind in ("tool_call", "tool_calls"):  # tool_choice required / named: spec is tool_call_schema's
            return self._compiler.compile_grammar(tool_call_grammar(c.spec, parallel=c.kind == "tool_calls"),
                                                  root_rule_name="tool_calls_root")
        if c.kind in ("json_tool_call", "json_tool_calls"):  # the same, in Llama 3's form
            return self._compiler.compile_grammar(
                json_tool_call_grammar(c.spec, parallel=c.kind == "json_tool_calls"), root_rule_name="tool_calls_root")
        raise ValueError(f"unknown constraint kind {c.kind!r}")

    def matcher(self, constraint: StructuredOutput) -> xgr.GrammarMatcher:
        """A fresh matcher at the grammar's start, for one request."""
        return xgr.GrammarMatcher(self.compile(constraint))


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> torch.Tensor:
    """Mask row ``i`` of ``logits`` ``[N, V]`` (float32, in place) to the tokens ``matchers[i]`` allows;
    rows without a matcher are untouched (the bitmask is filled and applied for the constrained rows only)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
    return logits
