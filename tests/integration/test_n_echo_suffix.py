"""n > 1, echo and suffix on ninfer-serve's HTTP face (issue #26 part 4), with the official openai client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.integration.test_ninfer_serve import client, serve

PROMPT = "Write a long story about a lighthouse keeper who collects seashells and talks to the gulls. " * 2


async def test_n_choices_share_the_prompt_prefill_and_each_has_its_own_seed_stream(tiny_model: Path,
                                                                                   tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path, max_concurrency=4, max_pending_requests=8) as s:
        c = client(s.url)
        messages = [{"role": "user", "content": PROMPT}]
        before = s.service.engine.snapshot().stats
        reply = await c.chat.completions.create(model="tiny", messages=messages, n=4, max_tokens=8, seed=7,
                                                extra_body={"ignore_eos": True})  # type: ignore[arg-type]
        after = s.service.engine.snapshot().stats
        assert [ch.index for ch in reply.choices] == [0, 1, 2, 3]
        prompt_tokens = reply.usage.prompt_tokens  # type: ignore[union-attr]
        assert reply.usage.completion_tokens == 4 * 8  # type: ignore[union-attr]  # the prompt counted once
        block = s.service.core.config.block_size
        shared = (prompt_tokens - 1) // block * block
        assert shared > 0
        # the prefix-hit counters: choices 1..3 found the first choice's full prompt blocks
        assert after.num_prompt_tokens_hit - before.num_prompt_tokens_hit == 3 * shared
        assert after.num_prompt_tokens_queried - before.num_prompt_tokens_queried == 4 * prompt_tokens
        # choice i is the request alone with seed + i
        for i in (0, 3):
            alone = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=7 + i,
                                                    extra_body={"ignore_eos": True})  # type: ignore[arg-type]
            assert alone.choices[0].message.content == reply.choices[i].message.content
        assert len({ch.message.content for ch in reply.choices}) > 1

        stream = await c.chat.completions.create(model="tiny", messages=messages, n=3, max_tokens=8, seed=7,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})  # type: ignore[arg-type]
        texts, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
        async for chunk in stream:
            if not chunk.choices:
                usage = chunk.usage
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
        assert finishes == {0: "length", 1: "length", 2: "length"}
        assert texts[0] == reply.choices[0].message.content and texts[2] == reply.choices[2].message.content
        assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens == prompt_tokens

        completion = await c.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=4, seed=1,
                                                extra_body={"ignore_eos": True})
        assert [ch.index for ch in completion.choices] == [0, 1]
        assert completion.usage.completion_tokens == 8  # type: ignore[union-attr]

        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model="tiny", messages=messages, n=5, max_tokens=2)
        assert err.value.body["param"] == "n" and "max concurrency" in err.value.body["message"]  # type: ignore[index]


async def test_echo_prepends_the_prompt_and_suffix_needs_fim_tokens(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path) as s:
        c = client(s.url)
        reply = await c.completions.create(model="tiny", prompt="hello there", max_tokens=4, echo=True, seed=3,
                                           extra_body={"ignore_eos": True})
        plain = await c.completions.create(model="tiny", prompt="hello there", max_tokens=4, seed=3,
                                           extra_body={"ignore_eos": True})
        assert reply.choices[0].text == "hello there" + plain.choices[0].text
        stream = await c.completions.create(model="tiny", prompt="hello there", max_tokens=4, echo=True, seed=3,
                                            stream=True, extra_body={"ignore_eos": True})
        assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == reply.choices[0].text
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model="tiny", prompt="x", max_tokens=2, echo=True, logprobs=1)
        assert err.value.body["param"] == "echo"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model="tiny", prompt="def f(", suffix="    return x\n", max_tokens=2)
        assert err.value.body["param"] == "suffix"  # type: ignore[index]
        assert "fill-in-the-middle" in err.value.body["message"]  # type: ignore[index]


async def test_suffix_is_served_as_fill_in_the_middle_when_the_tokenizer_has_fim_tokens(tmp_path: Path) -> None:
    from services.engine.tiny_checkpoint import build_tokenizer, write_tiny_checkpoint, write_tokenizer_files

    fim = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    model = write_tiny_checkpoint(tmp_path / "tiny-fim", arch="qwen3", vocab_size=512)
    tokenizer = build_tokenizer(512 - len(fim))
    tokenizer.add_special_tokens(list(fim))  # Qwen2.5-Coder's FIM tokens, as the last three ids
    write_tokenizer_files(model, tokenizer, 4096, eot_id=tokenizer.token_to_id("<|endoftext|>"),
                          im_end_id=tokenizer.token_to_id("<|im_end|>"))
    async with serve(model, tmp_path) as s:
        reply = await client(s.url).completions.create(model="tiny", prompt="def f(x):\n", suffix="    return y\n",
                                                       max_tokens=3, extra_body={"ignore_eos": True})
        expected = s.service.core.tokenizer.encode("<|fim_prefix|>def f(x):\n<|fim_suffix|>    return y\n"
                                                   "<|fim_middle|>")
        assert [s.service.core.tokenizer.token_to_id(t) for t in fim] == [509, 510, 511]
        assert {509, 510, 511} <= set(expected)
        assert reply.usage.prompt_tokens == len(expected)  # type: ignore[union-attr]
        assert reply.usage.completion_tokens == 3  # type: ignore[union-attr]
