"""Constrained decoding in the engine core (docs/openai_api.md, "Structured outputs").

A random-weight model's text is garbage, but under a grammar it is garbage that matches: every check
below parses or matches the output, so it fails if a mask is missing, misapplied or applied to the
wrong row.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams, StructuredOutput
from services.engine.engine_core import EngineCore
from services.engine.errors import InvalidParameterError
from services.engine.llm import LLM, greedy
from services.engine.spec.spec_decode import SpecConfig
from tests.unit.engine.fake_clock import FakeClock

SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar 0.2.9 lets a random model end a bounded string inside a UTF-8
        # character (docs/openai_api.md, "Known limits"), and this test counts characters
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA), strict=True)


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "kind", "tags"}
    assert isinstance(value["name"], str) and re.fullmatch("[a-z]{1,6}", value["name"])
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["kind"] in ("cat", "dog")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, bool) for t in value["tags"])


def sampled(constraint: StructuredOutput, seed: int, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured=constraint)


def test_json_schema_rows_parse_and_greedy_unconstrained_rows_next_to_them_are_unchanged(tiny_model: Path) -> None:
    llm = LLM(tiny_model, kv_capacity_tokens=4096, max_concurrency=8)
    prompts = [f"prompt number {i}" for i in range(8)]
    alone = llm.generate(prompts[:4], greedy(24, ignore_eos=True))
    mixed = llm.generate(prompts, [greedy(24, ignore_eos=True)] * 4 + [sampled(JSON, i) for i in range(4)])
    assert [c.token_ids for c in mixed[:4]] == [c.token_ids for c in alone]
    for c in mixed[4:]:
        assert c.finish_reason == "stop", c
        check_schema(c.text)
    # one schema, four requests: compiled once, then found in the cache
    assert (llm.core.grammars.num_misses, llm.core.grammars.num_hits) == (1, 3)


def test_regex_and_choice_hold_on_100_samples_at_temperature_1(tiny_model: Path) -> None:
    llm = LLM(tiny_model, kv_capacity_tokens=8192, max_concurrency=16, max_pending_requests=128)
    regex = StructuredOutput(kind="regex", spec=r"[a-z]{2,5}-[0-9]{1,3}")
    choice = StructuredOutput(kind="choice", choices=("yes", "no", "maybe \"so\""))
    params = [sampled(regex, i) for i in range(100)] + [sampled(choice, i) for i in range(100)]
    out = llm.generate(["pick"] * 200, params)
    assert all(re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", c.text) for c in out[:100]), [c.text for c in out[:100]]
    answers = [c.text for c in out[100:]]
    assert set(answers) <= {"yes", "no", 'maybe "so"'}
    assert len(set(answers)) >= 2  # temperature 1 over a random model: more than one choice comes up


def test_json_object_and_an_ebnf_grammar(tiny_model: Path) -> None:
    llm = LLM(tiny_model, kv_capacity_tokens=8192, max_concurrency=8)
    obj = StructuredOutput(kind="json_object")
    grammar = StructuredOutput(kind="grammar", spec='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?')
    out = llm.generate(["x"] * 16, [sampled(obj, i, 800) for i in range(8)] + [sampled(grammar, i) for i in range(8)])
    for c in out[:8]:
        if c.finish_reason == "stop":  # a random model may write one long string: max_tokens cuts it
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.startswith("{")
    assert sum(c.finish_reason == "stop" for c in out[:8]) >= 4
    assert all(re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", c.text) for c in out[8:] if c.finish_reason == "stop")


def test_constrained_rows_survive_chunked_prefill_preemption_and_prefix_cache_hits(tiny_model: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(4)]
    # 4 x (40 + ~60) tokens of KV needed, 192 fit: requests get preempted and recomputed; 16-token chunks
    llm = LLM(tiny_model, kv_capacity_tokens=192, block_size=4, max_concurrency=4, max_num_batched_tokens=16)
    out = llm.generate(prompts, [sampled(JSON, i, 140) for i in range(4)])
    assert llm.core.scheduler.stats().num_preemptions_total > 0
    for c in out:
        check_schema(c.text)
    # the same prompt again, now from the prefix cache: the grammar starts after the cached prompt all the same
    roomy = LLM(tiny_model, kv_capacity_tokens=2048, block_size=4)
    first, again = roomy.generate(prompts[:1], sampled(JSON, 1))[0], roomy.generate(prompts[:1], sampled(JSON, 2))[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 40 // 4 * 4 - 4)  # last block recomputed
    check_schema(again.text)


def test_constrained_rows_do_not_speculate_and_both_kinds_of_rows_are_right_in_one_batch(tiny_model: Path) -> None:
    spec = SpecConfig(method="draft", num_draft_tokens=3, draft_model_path=tiny_model)
    llm = LLM(tiny_model, kv_capacity_tokens=4096, max_concurrency=8, spec=spec)
    plain = LLM(tiny_model, kv_capacity_tokens=4096, max_concurrency=8)
    prompts = [f"the {i}th prompt" for i in range(6)]
    expected = plain.generate(prompts[:3], greedy(20, ignore_eos=True))
    out = llm.generate(prompts, [greedy(20, ignore_eos=True)] * 3 + [sampled(JSON, i) for i in range(3)])
    assert [c.token_ids for c in out[:3]] == [c.token_ids for c in expected]  # self-draft: drafts accepted
    for c in out[3:]:
        check_schema(c.text)
    counters = llm.core.spec_counters
    assert counters is not None and counters.snapshot().num_draft_tokens > 0


def test_a_schema_that_does_not_compile_is_an_invalid_parameter(tiny_model: Path) -> None:
    core = EngineCore(EngineConfig(model_path=tiny_model, kv_capacity_tokens=512))
    with pytest.raises(InvalidParameterError) as info:
        core.add_request("r", [5, 6], sampled(StructuredOutput(kind="regex", spec="(unclosed"), 0), FakeClock()())
    assert info.value.field == "response_format"
    assert not core.has_unfinished_requests()


def test_logit_bias_forces_and_bans_tokens_and_min_p_keeps_only_likely_tokens(tiny_model: Path) -> None:
    llm = LLM(tiny_model, kv_capacity_tokens=2048)
    forced = llm.generate(["a b"], replace(greedy(8, ignore_eos=True), logit_bias=((77, 100.0),)))
    assert forced[0].token_ids == (77,) * 8
    free = llm.generate(["a b"], greedy(8, ignore_eos=True))
    banned = llm.generate(["a b"], replace(greedy(8, ignore_eos=True), logit_bias=((free[0].token_ids[0], -100.0),)))
    assert banned[0].token_ids[0] != free[0].token_ids[0]
    # min_p = 1: only the most likely token survives, so temperature-1 sampling is the greedy output
    strict = llm.generate(["a b"], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True))
    assert strict[0].token_ids == free[0].token_ids


@pytest.mark.parametrize("constraint", [
    StructuredOutput(kind="json_schema", spec='{"type": 5}'),
    StructuredOutput(kind="json_schema", spec='{"$ref": "#/nope"}'),
    StructuredOutput(kind="json_schema", spec='{"type": "integer", "minimum": 10, "maximum": 1}'),
    StructuredOutput(kind="regex", spec="a**"),
    StructuredOutput(kind="grammar", spec="root ::= undefined_rule"),
    StructuredOutput(kind="choice", choices=()),
])
def test_hostile_constraints_are_invalid_parameters_with_xgrammars_reason(tiny_model: Path,
                                                                        constraint: StructuredOutput) -> None:
    from services.engine.model.grammar import GrammarCache
    from services.engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model)
    cache = GrammarCache(tokenizer, tokenizer.vocab_size, tokenizer.stop_token_ids)
    with pytest.raises(InvalidParameterError) as info:
        cache.compile(constraint)
    assert info.value.field == "response_format"
    assert "cannot be compiled" in info.value.message and "/project/cpp" not in info.value.message
    assert cache.num_misses == 0
