"""Reasoning on ninfer-serve's HTTP face (issue #26 part 3), with the official openai client: a tiny Qwen3
checkpoint whose chat template opens <think> in the generation prompt (as DeepSeek-R1's and Qwen3-Thinking's
do) and honours enable_thinking, as Qwen3's does."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.integration.test_ninfer_serve import client, serve

THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
USER = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-thinking", arch="qwen3")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


def _end_id(s) -> int:  # type: ignore[no-untyped-def]
    end = s.service.core.tokenizer.token_to_id("</think>")
    assert end is not None
    return end


async def test_a_think_block_is_reasoning_content_and_one_cut_by_max_tokens_stays_reasoning(
        thinking_model: Path, tmp_path: Path) -> None:
    async with serve(thinking_model, tmp_path) as s:
        c = client(s.url)
        # the model may not close the block (</think> banned): max_tokens cuts it, all of it is reasoning
        reply = await c.chat.completions.create(
            model="tiny", messages=USER, max_tokens=10, temperature=0,
            extra_body={"ignore_eos": True, "logit_bias": {str(_end_id(s)): -100}})
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "length"
        assert message.model_extra["reasoning_content"] and message.model_extra["reasoning"] == \
            message.model_extra["reasoning_content"]
        assert "<think>" not in message.model_extra["reasoning_content"] and not message.content
        assert reply.usage.completion_tokens_details.reasoning_tokens == 10  # type: ignore[union-attr]


async def test_reasoning_effort_forces_the_end_of_thinking_at_its_budget_streamed_and_not(
        thinking_model: Path, tmp_path: Path) -> None:
    async with serve(thinking_model, tmp_path, reasoning_budget_tokens=(4, 8, 16)) as s:
        c = client(s.url)
        args = {"model": "tiny", "messages": USER, "max_tokens": 24, "temperature": 0,
                "extra_body": {"ignore_eos": True, "logit_bias": {str(_end_id(s)): -100}}}
        for effort, budget in (("low", 4), ("medium", 8)):
            reply = await c.chat.completions.create(reasoning_effort=effort, **args)  # type: ignore[arg-type]
            message = reply.choices[0].message
            # the budget's tokens, then the forced </think> (counted: the block's tags are reasoning tokens)
            assert reply.usage.completion_tokens_details.reasoning_tokens == budget + 1  # type: ignore[union-attr]
            assert reply.usage.completion_tokens == 24  # type: ignore[union-attr]
            assert message.model_extra["reasoning_content"] and message.content
            assert "</think>" not in message.content and "</think>" not in message.model_extra["reasoning_content"]

            stream = await c.chat.completions.create(reasoning_effort=effort, stream=True,  # type: ignore[arg-type]
                                                     stream_options={"include_usage": True}, **args)
            kinds, reasoning, content = [], "", ""
            async for chunk in stream:
                if not chunk.choices:
                    usage = chunk.usage
                    continue
                delta = chunk.choices[0].delta
                if (piece := (delta.model_extra or {}).get("reasoning_content")):
                    kinds.append("r")
                    reasoning += piece
                    assert delta.model_extra["reasoning"] == piece
                if delta.content:
                    kinds.append("c")
                    content += delta.content
            assert reasoning == message.model_extra["reasoning_content"] and content == message.content
            assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds  # reasoning first
            assert usage.completion_tokens_details.reasoning_tokens == budget + 1  # type: ignore[union-attr]
        # n choices: each split on its own, the reasoning tokens summed
        both = await c.chat.completions.create(n=2, reasoning_effort="low", **args)  # type: ignore[arg-type]
        assert all(ch.message.model_extra["reasoning_content"] and ch.message.content for ch in both.choices)
        assert both.usage.completion_tokens_details.reasoning_tokens == 2 * 5  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                            extra_body={"reasoning_effort": "extreme"})
        assert err.value.body["param"] == "reasoning_effort"  # type: ignore[index]


async def test_thinking_off_per_request_and_by_the_engine_flag(thinking_model: Path, tmp_path: Path) -> None:
    args = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    async with serve(thinking_model, tmp_path) as s:
        c = client(s.url)
        for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
            reply = await c.chat.completions.create(**{**args, "extra_body": {"ignore_eos": True, **extra}})
            assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
            assert reply.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(**{**args, "extra_body": {"chat_template_kwargs": {"messages": []}}})
        assert err.value.body["param"] == "chat_template_kwargs.messages"  # type: ignore[index]
    async with serve(thinking_model, tmp_path, enable_thinking=False) as s:  # --no-thinking
        c = client(s.url)
        off = await c.chat.completions.create(**args)  # type: ignore[call-overload]
        assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
        on = await c.chat.completions.create(**{**args, "extra_body": {
            "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}}})
        assert on.usage.completion_tokens_details.reasoning_tokens > 0  # type: ignore[union-attr]
        assert on.usage.prompt_tokens < off.usage.prompt_tokens  # type: ignore[union-attr]  # no empty block


async def test_a_model_without_thinking_returns_no_reasoning_field(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s:
        reply = await client(s.url).chat.completions.create(model="tiny", messages=USER, max_tokens=6,
                                                            reasoning_effort="low", extra_body={"ignore_eos": True})
        assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]


async def test_preserve_thinking_keeps_earlier_turns_reasoning_in_the_prompt(thinking_model: Path,
                                                                             tmp_path: Path) -> None:
    history = [*USER, {"role": "assistant", "content": "42", "reasoning_content": "six sevens are forty-two"},
               {"role": "user", "content": "And 6 times 8?"}]
    counts = {}
    for preserve in (False, True):
        async with serve(thinking_model, tmp_path, preserve_thinking=preserve) as s:
            reply = await client(s.url).chat.completions.create(model="tiny", messages=history, max_tokens=1)
            counts[preserve] = reply.usage.prompt_tokens  # type: ignore[union-attr]
            prompt = s.service.core.tokenizer.apply_chat_template(
                [dict(m) for m in history], preserve_thinking=preserve)
            assert ("<think>\nsix sevens are forty-two\n</think>\n\n42" in prompt) is preserve
    assert counts[True] > counts[False]


async def test_reasoning_through_the_gateway_to_a_bus_member(nats_server, thinking_model: Path,  # type: ignore[no-untyped-def]
                                                             tmp_path: Path) -> None:
    """The bus carries reasoning_effort and chat_template_kwargs out and the reasoning text and tokens back."""
    import contextlib

    from services.common.bus import connect
    from services.common.http import serving
    from services.gateway import pools
    from services.gateway.service import GatewayConfig, GatewayService
    from tests.integration.conftest import start_engine_and_ledger, wait_for

    async with contextlib.AsyncExitStack() as es:
        await start_engine_and_ledger(es, nats_server.url, thinking_model, tmp_path,
                                      reasoning_budget_tokens=(4, 8, 16))  # type: ignore[arg-type]
        gw_nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(gw_nc.drain)
        gateway = GatewayService(gw_nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path))
        await es.enter_async_context(gateway.running())
        base_url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        await wait_for(lambda: "tiny" in pools.model_names(gateway.pools_file.file_config, gateway.fleet), 120)
        assert gateway.bootstrap is not None
        c = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=gateway.bootstrap[1], max_retries=0)
        reply = await c.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0,
                                                reasoning_effort="low", extra_body={"ignore_eos": True})
        assert reply.choices[0].message.model_extra["reasoning_content"]
        assert 1 <= reply.usage.completion_tokens_details.reasoning_tokens <= 5  # type: ignore[union-attr]
        stream = await c.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0,
                                                 reasoning_effort="low", stream=True, extra_body={"ignore_eos": True})
        reasoning = "".join([(ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                             async for ch in stream if ch.choices])
        assert reasoning == reply.choices[0].message.model_extra["reasoning_content"]
        off = await c.chat.completions.create(model="tiny", messages=USER, max_tokens=4, extra_body={
            "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
        assert "reasoning_content" not in (off.choices[0].message.model_extra or {})


async def test_a_constrained_answer_follows_the_unconstrained_reasoning(thinking_model: Path, tmp_path: Path) -> None:
    async with serve(thinking_model, tmp_path, reasoning_budget_tokens=(4, 8, 16)) as s:
        c = client(s.url)
        for temperature in (0.0, 1.0, 1.0):
            reply = await c.chat.completions.create(
                model="tiny", messages=USER, max_tokens=16, temperature=temperature, reasoning_effort="low",
                extra_body={"guided_choice": ["yes", "no"], "logit_bias": {str(_end_id(s)): -100}})
            message = reply.choices[0].message
            assert message.model_extra["reasoning_content"]  # free text: the grammar waited for </think>
            assert reply.usage.completion_tokens_details.reasoning_tokens == 5  # type: ignore[union-attr]
            assert message.content in ("yes", "no") and reply.choices[0].finish_reason == "stop"


async def test_the_responses_api_returns_the_think_block_as_a_reasoning_item_streamed_and_not(
        thinking_model: Path, tmp_path: Path) -> None:
    """/v1/responses on a thinking model: a ``reasoning`` output item (reasoning_text content) before the
    message, ``reasoning.effort`` is the thinking budget, usage counts the reasoning tokens; the stream's
    reasoning_text deltas add up to the item's text."""
    async with serve(thinking_model, tmp_path, reasoning_budget_tokens=(4, 8, 16)) as s:
        c = client(s.url)
        args = {"model": "tiny", "input": "What is 6 times 7?", "max_output_tokens": 24, "temperature": 0,
                "reasoning": {"effort": "low"},
                "extra_body": {"ignore_eos": True, "logit_bias": {str(_end_id(s)): -100}}}
        reply = await c.responses.create(**args)  # type: ignore[call-overload]
        kinds = [item.type for item in reply.output]
        assert kinds[0] == "reasoning" and "message" in kinds, kinds
        thought = reply.output[0].content[0].text  # type: ignore[union-attr]
        assert thought and "<think>" not in thought and "</think>" not in reply.output_text
        assert reply.usage is not None and reply.usage.output_tokens_details.reasoning_tokens == 5  # 4 + </think>
        assert reply.reasoning is not None and reply.reasoning.effort == "low"

        stream = await c.responses.create(stream=True, **args)  # type: ignore[call-overload]
        deltas, done = "", None
        async for event in stream:
            if event.type == "response.reasoning_text.delta":
                deltas += event.delta
            elif event.type in ("response.completed", "response.incomplete"):  # cut by max_output_tokens
                done = event.response
        assert done is not None and deltas == done.output[0].content[0].text == thought  # type: ignore[union-attr]

        with pytest.raises(openai.BadRequestError) as refused:  # a summary we cannot write: named, not ignored
            await c.responses.create(model="tiny", input="hi", reasoning={"effort": "low", "summary": "auto"})
        assert "reasoning" in str(refused.value)
