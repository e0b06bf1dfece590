"""n > 1, echo and suffix through the gateway to a real bus member (issue #26 item 6), with the official
openai client: the same choices, text and usage as the engine's own HTTP face gives for the same request, the
prompt prefilled once (prefix-hit counters), and the ledger's row billing the prompt once and every choice's
output."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from services.accounting.service import AccountingService
from services.common.bus import connect
from services.common.http import serving
from services.engine.serve.async_engine import AsyncEngine
from services.gateway import pools
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import start_engine_and_ledger, wait_for
from tests.integration.test_ninfer_serve import client, serve
from tests.integration.test_reasoning import USER, thinking_model  # noqa: F401  (a fixture)
from tests.integration.test_usage_truth import fleet, raw_stream

PROMPT = "Write a long story about a lighthouse keeper who collects seashells and talks to the gulls. " * 2
NO_EOS: Any = {"ignore_eos": True}  # a random-weight model may sample its EOS early


@dataclass
class BusStack:
    sdk: openai.AsyncOpenAI  # to the gateway
    engine: AsyncEngine  # the bus member's engine
    accounting: AccountingService

    async def rows(self, n: int) -> list[dict[str, Any]]:
        """The ledger's request rows once ``n`` are in (and no more come within a moment)."""
        sql = "SELECT prompt_tokens, cached_tokens, output_tokens, usage_source, status FROM requests"
        async with asyncio.timeout(120):
            while len((await self.accounting.run_sql(sql))[1]) < n:
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        columns, rows = await self.accounting.run_sql(sql)
        assert len(rows) == n
        return [dict(zip(columns, r, strict=True)) for r in rows]


@contextlib.asynccontextmanager
async def bus_stack(nats_url: str, model: Path, tmp_path: Path, **engine: Any) -> AsyncIterator[BusStack]:
    async with contextlib.AsyncExitStack() as es:
        parts = await start_engine_and_ledger(es, nats_url, model, tmp_path, **{
            "kv_capacity_tokens": 4096, "max_concurrency": 4, "max_pending_requests": 8, **engine})
        gw_nc = await connect(nats_url, "gateway")
        es.push_async_callback(gw_nc.drain)
        gateway = GatewayService(gw_nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path))
        await es.enter_async_context(gateway.running())
        base_url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        await wait_for(lambda: "tiny" in pools.model_names(gateway.pools_file.file_config, gateway.fleet), 120)
        assert gateway.bootstrap is not None
        sdk = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=gateway.bootstrap[1], max_retries=0, timeout=120)
        yield BusStack(sdk, parts.engine, parts.accounting)


def _usage(u: Any) -> tuple[int, int, int]:
    return u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens


async def test_n_choices_cross_the_bus_as_the_engines_own_http_face_answers_them(
        nats_server, tiny_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "http").mkdir()
    async with bus_stack(nats_server.url, tiny_model, tmp_path) as bus, \
            serve(tiny_model, tmp_path / "http", max_concurrency=4, max_pending_requests=8) as direct:
        http = client(direct.url)
        block = direct.service.core.config.block_size

        # chat, not streamed: a prompt neither engine has seen, so choice 0 computes all of it
        messages = [{"role": "user", "content": "1: " + PROMPT}]
        before = bus.engine.snapshot().stats
        reply = await bus.sdk.chat.completions.create(model="tiny", messages=messages, n=4, max_tokens=6, seed=7,  # type: ignore[arg-type]
                                                      extra_body=NO_EOS)
        after = bus.engine.snapshot().stats
        own = await http.chat.completions.create(model="tiny", messages=messages, n=4, max_tokens=6, seed=7,  # type: ignore[arg-type]
                                                 extra_body=NO_EOS)
        assert [ch.index for ch in reply.choices] == [0, 1, 2, 3]
        assert [ch.message.content for ch in reply.choices] == [ch.message.content for ch in own.choices]
        assert _usage(reply.usage) == _usage(own.usage)
        prompt_tokens = reply.usage.prompt_tokens  # type: ignore[union-attr]
        assert reply.usage.completion_tokens == 4 * 6  # type: ignore[union-attr]  # the prompt counted once
        shared = (prompt_tokens - 1) // block * block
        assert shared > 0
        # one prefill: choices 1..3 found choice 0's full prompt blocks in the bus engine's prefix cache
        assert after.num_prompt_tokens_hit - before.num_prompt_tokens_hit == 3 * shared
        assert after.num_prompt_tokens_queried - before.num_prompt_tokens_queried == 4 * prompt_tokens
        print(f"\nFIGURES n-bus: prompt_tokens={prompt_tokens} prefix_hit_tokens="
              f"{after.num_prompt_tokens_hit - before.num_prompt_tokens_hit} (3 x {shared})")

        # chat, streamed (a new prompt): four choices' deltas, each finished, the usage summed
        messages = [{"role": "user", "content": "2: " + PROMPT}]
        own = await http.chat.completions.create(model="tiny", messages=messages, n=4, max_tokens=6, seed=7,  # type: ignore[arg-type]
                                                 extra_body=NO_EOS)
        stream = await bus.sdk.chat.completions.create(model="tiny", messages=messages, n=4, max_tokens=6, seed=7,  # type: ignore[arg-type]
                                                       stream=True, stream_options={"include_usage": True},
                                                       extra_body=NO_EOS)
        texts, finishes, usage = dict.fromkeys(range(4), ""), {}, None
        async for chunk in stream:
            if not chunk.choices:
                usage = chunk.usage
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
        assert finishes == dict.fromkeys(range(4), "length")
        assert list(texts.values()) == [ch.message.content for ch in own.choices]
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (own.usage.prompt_tokens, 24)  # type: ignore[union-attr]

        # completions, not streamed and streamed
        prompt = "3: " + PROMPT
        own_c = await http.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=5, seed=3, extra_body=NO_EOS)
        bus_c = await bus.sdk.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=5, seed=3,
                                                 extra_body=NO_EOS)
        assert [ch.index for ch in bus_c.choices] == [0, 1, 2, 3]
        assert [ch.text for ch in bus_c.choices] == [ch.text for ch in own_c.choices]
        assert _usage(bus_c.usage) == _usage(own_c.usage) and bus_c.usage.completion_tokens == 4 * 5  # type: ignore[union-attr]
        streamed = await bus.sdk.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=5, seed=3, stream=True,
                                                    stream_options={"include_usage": True}, extra_body=NO_EOS)
        pieces, c_usage = dict.fromkeys(range(4), ""), None
        async for chunk in streamed:
            if not chunk.choices:
                c_usage = chunk.usage
            for ch in chunk.choices:
                pieces[ch.index] += ch.text
        assert list(pieces.values()) == [ch.text for ch in own_c.choices]
        assert c_usage is not None and c_usage.completion_tokens == 20

        # the ledger: one row per request, the prompt billed once and all four choices' output, as the
        # client's usage said (the streamed completion's prompt came from the prefix cache: same count)
        rows = await bus.rows(4)
        expected = sorted([(reply.usage.prompt_tokens, 24), (usage.prompt_tokens, 24),  # type: ignore[union-attr]
                           (bus_c.usage.prompt_tokens, 20), (c_usage.prompt_tokens, 20)])  # type: ignore[union-attr]
        assert sorted((r["prompt_tokens"], r["output_tokens"]) for r in rows) == expected
        assert {(r["status"], r["usage_source"]) for r in rows} == {("ok", "member")}

        # the engine still bounds n by its concurrency, through the gateway too
        with pytest.raises(openai.BadRequestError) as err:
            await bus.sdk.chat.completions.create(model="tiny", messages=messages, n=5, max_tokens=2)  # type: ignore[arg-type]
        assert err.value.body["param"] == "n" and "max concurrency" in err.value.body["message"]  # type: ignore[index]


def _fim_model(tmp_path: Path) -> Path:
    """The tiny checkpoint with Qwen2.5-Coder's fill-in-the-middle tokens as its last three ids."""
    from services.engine.tiny_checkpoint import build_tokenizer, write_tiny_checkpoint, write_tokenizer_files

    fim = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    model = write_tiny_checkpoint(tmp_path / "tiny-fim", arch="qwen3", vocab_size=512)
    tokenizer = build_tokenizer(512 - len(fim))
    tokenizer.add_special_tokens(list(fim))
    write_tokenizer_files(model, tokenizer, 4096, eot_id=tokenizer.token_to_id("<|endoftext|>"),
                          im_end_id=tokenizer.token_to_id("<|im_end|>"))
    return model


async def test_echo_and_suffix_cross_the_bus(nats_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = _fim_model(tmp_path)
    async with bus_stack(nats_server.url, model, tmp_path) as bus:
        c = bus.sdk
        echoed = await c.completions.create(model="tiny", prompt="hello there", max_tokens=4, echo=True, seed=3,
                                            extra_body=NO_EOS)
        plain = await c.completions.create(model="tiny", prompt="hello there", max_tokens=4, seed=3, extra_body=NO_EOS)
        assert echoed.choices[0].text == "hello there" + plain.choices[0].text
        stream = await c.completions.create(model="tiny", prompt="hello there", max_tokens=4, echo=True, seed=3,
                                            stream=True, extra_body=NO_EOS)
        assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == echoed.choices[0].text
        two = await c.completions.create(model="tiny", prompt="hello there", max_tokens=4, echo=True, seed=3, n=2,
                                         extra_body=NO_EOS)
        assert two.choices[0].text == echoed.choices[0].text and two.choices[1].text.startswith("hello there")

        # suffix: the engine builds the fill-in-the-middle prompt (its FIM tokens counted in the prompt)
        filled = await c.completions.create(model="tiny", prompt="def f(x):\n", suffix="    return y\n", max_tokens=3,
                                            extra_body=NO_EOS)
        expected = bus.engine.core.tokenizer.encode("<|fim_prefix|>def f(x):\n<|fim_suffix|>    return y\n"
                                                    "<|fim_middle|>")
        assert filled.usage.prompt_tokens == len(expected)  # type: ignore[union-attr]
        assert filled.usage.completion_tokens == 3  # type: ignore[union-attr]

        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model="tiny", prompt="x", max_tokens=2, echo=True, logprobs=1)
        assert err.value.body["param"] == "echo" and "prompt's logprobs" in err.value.body["message"]  # type: ignore[index]


async def test_continuous_usage_counts_each_choices_reasoning_tokens_as_they_come(
        nats_server, thinking_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """stream_options.continuous_usage_stats: every chunk, the reasoning deltas included, carries the usage
    so far with its reasoning tokens (both choices', over the bus), ending at the final usage's."""
    async with bus_stack(nats_server.url, thinking_model, tmp_path, reasoning_budget_tokens=(4, 8, 16)) as bus:
        end_id = bus.engine.core.tokenizer.token_to_id("</think>")
        stream = await bus.sdk.chat.completions.create(
            model="tiny", messages=USER, n=2, max_tokens=12, temperature=0, reasoning_effort="low", stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": True, "logit_bias": {str(end_id): -100}})
        running: list[tuple[int, int]] = []  # (completion, reasoning) tokens so far, chunk by chunk
        reasoning_chunks, final = 0, None
        async for chunk in stream:
            if not chunk.choices:
                final = chunk.usage
                continue
            assert chunk.usage is not None, chunk
            running.append((chunk.usage.completion_tokens, chunk.usage.completion_tokens_details.reasoning_tokens))  # type: ignore[union-attr]
            if (chunk.choices[0].delta.model_extra or {}).get("reasoning_content"):
                reasoning_chunks += 1
                assert running[-1][1] >= 1
        assert final is not None and reasoning_chunks >= 2
        # each choice: the low budget's 4 tokens and the forced </think>, then the answer
        assert final.completion_tokens_details.reasoning_tokens == 2 * 5  # type: ignore[union-attr]
        assert running == sorted(running) and running[-1] == (2 * 12, 2 * 5)


async def test_a_client_gone_mid_stream_bills_every_choices_work_once_the_engine_reports_it(
        nats_server, long_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    async with fleet(nats_server, long_model, tmp_path) as f:
        rid, events, _ = await raw_stream(f.url, f.key, {
            "model": "tiny", "stream": True, "n": 2, "max_tokens": 3000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "cut me off"}]}, 5)
        assert events >= 5
        row = (await f.rows(1))[rid]
        outs = [f.engine_outputs[f"{rid}-{i}"] for i in range(2)]
        assert [o.finish_reason for o in outs] == ["abort", "abort"]
        # the prompt once, the two choices' output as the engine counted it at the cut
        assert (row["prompt_tokens"], row["output_tokens"]) == (outs[0].num_prompt_tokens,
                                                                outs[0].num_output_tokens + outs[1].num_output_tokens)
        assert row["status"] == "aborted" and row["usage_source"] == "engine", row


async def test_an_engine_from_before_n_is_cancelled_and_named_instead_of_answering_one_choice(
        nats_server) -> None:  # type: ignore[no-untyped-def]
    """An older engine reads past ``n`` and accepts without ``num_choices`` (its TokenChunk has no such
    field): the gateway's bus hop cancels it there and refuses with a 400 naming the member."""
    from nats.aio.msg import Msg

    from proto import Cancel, GenerateRequest, TokenChunk, Usage, decode, encode, subjects
    from services.gateway import bus_backend
    from services.gateway.errors import WorkerUnavailable

    engine_nc, gw_nc = await connect(nats_server.url, "engine"), await connect(nats_server.url, "gateway")
    try:
        cancels: asyncio.Queue[str] = asyncio.Queue()

        async def old_engine(msg: Msg) -> None:  # the acceptance as an engine before issue #26 item 6 sent it
            req = decode(msg.data, GenerateRequest)
            accepted = TokenChunk(request_id=req.request_id, index=0, worker_id="w1",
                                  usage=Usage(prompt_tokens=3, completion_tokens=0))
            assert accepted.num_choices is None  # what decoding the older engine's chunk gives
            await engine_nc.publish(msg.reply, encode(accepted))

        async def on_cancel(msg: Msg) -> None:
            await cancels.put(decode(msg.data, Cancel).request_id)

        await engine_nc.subscribe(subjects.gen("w1"), cb=old_engine)
        await engine_nc.subscribe(subjects.cancel("w1"), cb=on_cancel)
        await engine_nc.flush()
        # a plain request is served by the older engine as before. First, and until it is answered: in two full
        # fresh-clone runs the first request after the engine's flushed SUB got nats-server's "no responders"
        # (it passed alone each time; the cause was not found). A real gateway routes to an engine only after
        # its heartbeats, seconds after its subscription
        for attempt in range(50):
            try:
                stream = await bus_backend.start(gw_nc, "w1", GenerateRequest(request_id="plain", model="tiny",
                                                                              prompt="hi"), 120, 120)
                break
            except WorkerUnavailable as exc:
                if "no responder" not in str(exc) or attempt == 49:
                    raise
                await asyncio.sleep(0.1)
        assert stream.num_choices == 1
        await stream.close()
        for ask in ({"n": 2}, {"echo": True}, {"suffix": "end"}):
            req = GenerateRequest(request_id=f"r-{len(ask)}-{next(iter(ask))}", model="tiny", prompt="hi", **ask)
            with pytest.raises(WorkerUnavailable) as err:
                await bus_backend.start(gw_nc, "w1", req, 120, 120)
            assert err.value.error is not None and err.value.error.status == 400
            assert err.value.error.code == "model_not_supported" and "w1" in err.value.error.message
            async with asyncio.timeout(120):
                assert await cancels.get() == req.request_id
    finally:
        await gw_nc.drain()
        await engine_nc.drain()


async def test_admission_reserves_max_tokens_for_each_of_n_choices(nats_server, long_model: Path,  # type: ignore[no-untyped-def]
                                                                  tmp_path: Path) -> None:
    from services.gateway.identity import hash_password
    from services.gateway.limits import Limits, key_principal
    from tests.integration.test_limits import PROMPT as LIMITS_PROMPT
    from tests.integration.test_limits import replicas

    async with replicas(nats_server, long_model, tmp_path, n=1) as r:
        gw = r.gateways[0]
        user = gw.identity.create_user("nina", hash_password("nina-password-1"), "user")
        key, record = gw.identity.create_key(user.user_id, "k", None, time.time())
        gw.identity.set_limits(key_principal(record.key_id), Limits(tokens_per_minute=10_000))
        if time.time() % 60 > 50:  # the header must be read in the minute window it was booked in
            await asyncio.sleep(61 - time.time() % 60)
        raw = await r.sdk(key).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": LIMITS_PROMPT}], max_tokens=4, n=4)
        assert len(raw.parse().choices) == 4
        # the prompt estimate (no history yet: ceil(13 characters / 4) = 4) + 4 choices x max_tokens 4
        assert raw.headers["x-ratelimit-remaining-tokens"] == str(10_000 - (4 + 4 * 4))
