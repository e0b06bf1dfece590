"""ReasoningSplitter: the <think> block split from the answer, the same whole and streamed at every split."""

from __future__ import annotations

import pytest

from services.common import openai_api
from services.engine.serve.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    # (reply, the prompt opened <think>, reasoning, content)
    ("<think>\nplan\n</think>\n\nThe answer is 42.", False, "\nplan\n", "The answer is 42."),
    ("  <think>plan</think>answer", False, "plan", "answer"),
    ("plan step</think>\n\nanswer", True, "plan step", "answer"),
    ("no thinking here <think>x</think>", False, "", "no thinking here <think>x</think>"),
    ("<think>cut by max_tokens </thi", False, "cut by max_tokens </thi", ""),
    ("still reasoning", True, "still reasoning", ""),
    ("<thi", False, "", "<thi"),
    ("\n\n", False, "", "\n\n"),
    ("<think>a</think>b<think>c</think>", False, "a", "b<think>c</think>"),
]


@pytest.mark.parametrize(("reply", "starts_inside", "reasoning", "content"), CASES)
def test_whole_and_every_streamed_split_agree(reply: str, starts_inside: bool, reasoning: str, content: str) -> None:
    assert split_reasoning(reply, starts_inside=starts_inside) == (reasoning, content)
    for size in range(1, len(reply) + 1):
        splitter = ReasoningSplitter(starts_inside=starts_inside)
        got_r, got_c = "", ""
        for at in range(0, len(reply), size):
            r, c = splitter.push(reply[at:at + size])
            assert not (got_c and r), "reasoning after content"
            got_r, got_c = got_r + r, got_c + c
        r, c = splitter.finish()
        assert (got_r + r, got_c + c) == (reasoning, content), size


def test_the_parser_reads_reasoning_fields_and_bounds_n() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a", "reasoning_content": "why"},
                                       {"role": "user", "content": "q2"}],
            "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}, "n": 3}
    parsed = openai_api.parse_request(body, "chat.completions")
    g = parsed.generate
    assert g.reasoning_effort == "low" and g.chat_template_kwargs == {"enable_thinking": False}
    assert g.messages is not None and g.messages[1].reasoning == "why" and parsed.n == 3
    assert g.n == 3 and "n" not in parsed.unsupported  # carried to bus members too (GenerateRequest.n)
    for bad, param in (({"reasoning_effort": "max"}, "reasoning_effort"), ({"chat_template_kwargs": []},
                       "chat_template_kwargs"), ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": True}, "n")):
        with pytest.raises(openai_api.InvalidRequest) as err:
            openai_api.parse_request({**body, **bad}, "chat.completions")
        assert err.value.param == param


def test_ninfer_serve_reasoning_flags_reach_the_engine_config(tiny_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from services.common.runtime import ConfigError
    from services.engine.__main__ import add_arguments, build_config

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)

    def config(*flags: str):  # type: ignore[no-untyped-def]
        return build_config(parser.parse_args([str(tiny_model), "--data-dir", str(tmp_path), *flags]))[0]

    default = config()
    assert default.enable_thinking and default.reasoning_effort is None
    assert default.reasoning_budget_tokens == (1024, 4096, 16384)
    flagged = config("--no-thinking", "--reasoning-effort", "low", "--reasoning-budget-tokens", "8,16,32",
                     "--preserve-thinking")
    assert not flagged.enable_thinking and flagged.reasoning_effort == "low" and flagged.preserve_thinking
    assert flagged.reasoning_budget_tokens == (8, 16, 32)
    for bad in ("8,16", "32,16,8", "a,b,c"):
        with pytest.raises(ConfigError, match="reasoning-budget-tokens"):
            config("--reasoning-budget-tokens", bad)
