"""Tokenizer: encode/decode, chat templating (thinking stripped or preserved), streaming detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.errors import ChatTemplateError, ModelLoadError
from services.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer, strip_thinking
from services.engine.tiny_checkpoint import write_tiny_checkpoint

MULTIBYTE = "héllo 世界 🎉 𝄞 naïve"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tiny_checkpoint(tmp_path_factory.mktemp("tok"), "qwen3"))


def test_text_round_trips_through_encode_and_decode(tokenizer: Tokenizer) -> None:
    text = "Return the absolute value of the argument.\n" + MULTIBYTE
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode())  # BPE merged something
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_stop_ids_come_from_the_tokenizer_files(tokenizer: Tokenizer) -> None:
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == im_end
    assert tokenizer.bos_token is None
    assert tokenizer.stop_token_ids == (im_end, endoftext)  # eos, then generation_config's other id
    assert set(tokenizer.special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert tokenizer.vocab_size == 512
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and ids[-1] == im_end
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_think_tags_are_single_ordinary_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<think>x</think>")
    assert ids[0] == tokenizer.token_to_id("<think>") and ids[-1] == tokenizer.token_to_id("</think>")
    assert tokenizer.decode(ids) == "<think>x</think>"  # not special: survives skip_special_tokens


def test_chat_template_renders_chatml_with_a_generation_prompt(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("hi<|im_end|>\n")


HISTORY = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "<think>\nwhy\n</think>\n\nA1"},
    {"role": "user", "content": "q2"},
]


def test_earlier_thinking_is_stripped_by_default(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(HISTORY)
    assert "<|im_start|>assistant\nA1<|im_end|>" in prompt
    assert "why" not in prompt
    assert HISTORY[1]["content"].startswith("<think>")  # the caller's messages are not mutated


def test_earlier_thinking_is_kept_with_preserve_thinking(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(HISTORY, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nwhy\n</think>\n\nA1<|im_end|>" in prompt


def test_thinking_after_the_last_user_turn_is_kept(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>plan</think>go"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert "<think>plan</think>go" in prompt


def test_strip_thinking_handles_a_reply_that_starts_inside_reasoning() -> None:
    assert strip_thinking("plan step\n</think>\n\nanswer") == "answer"
    assert strip_thinking("a <think>x</think>b <think>y</think>c") == "a b c"
    assert strip_thinking([{"type": "text", "text": "<think>x</think>ok"}]) == [
        {"type": "text", "text": "ok"}
    ]


def test_a_template_exception_becomes_a_chat_template_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match='unknown role "wizard"') as info:
        tokenizer.apply_chat_template([{"role": "wizard", "content": "x"}])
    assert isinstance(info.value, ValueError)


def test_a_template_type_error_becomes_a_chat_template_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        tokenizer.apply_chat_template([{"role": "user", "content": 5}])


def test_a_model_without_a_chat_template_says_so(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "qwen3")
    (path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


def test_a_directory_without_tokenizer_json_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)


def test_incremental_detokenizer_never_splits_a_multibyte_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    # The test can fail only if some character really is split across tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # at least one step held a partial character back
    assert "".join(deltas) == MULTIBYTE == detok.text


def test_incremental_detokenizer_skips_special_tokens_and_ignores_the_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    out = "".join(detok.push(i) for i in tokenizer.encode("Done 🎉<|im_end|>")) + detok.flush()
    assert out == "Done 🎉"


def test_flush_emits_a_dangling_partial_character_once(tokenizer: Tokenizer) -> None:
    first_byte_token = next(i for i in tokenizer.encode("𝄞") if "\ufffd" in tokenizer.decode([i]))
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(first_byte_token) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


# A template in the style of Qwen3.5's and Llama's: one system turn, first; any other role refused.
STRICT = ("{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('System message must be at the beginning.') }}"
          "{%- elif m.role not in ('system', 'user', 'assistant') %}{{ raise_exception('Unexpected message role.') }}"
          "{%- endif %}<{{ m.role }}>{{ m.content }}{%- endfor %}")


def test_the_developer_role_is_a_system_turn_for_a_template_that_does_not_know_it(tokenizer: Tokenizer) -> None:
    strict = Tokenizer(tokenizer._tok, {}, chat_template=STRICT)
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert strict.apply_chat_template(turns, add_generation_prompt=False) == "<system>Be brief.<user>hi"
    # instructions (system) and a developer turn (the Responses API, coding agents): one leading system turn
    assert strict.apply_chat_template([{"role": "system", "content": "A."}, {"role": "developer", "content": [
        {"type": "text", "text": "B."}]}, {"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<system>A.\n\nB.<user>hi")
    # a template that knows the role gets it as sent
    knows = Tokenizer(tokenizer._tok, {}, chat_template="{% for m in messages %}{% if m.role == 'developer' %}"
                                                         "[dev]{% endif %}{{ m.content }};{% endfor %}")
    assert knows.apply_chat_template([{"role": "developer", "content": "x"}], add_generation_prompt=False) == "[dev]x;"
    with pytest.raises(ChatTemplateError, match="Unexpected message role"):  # other roles still reach the template
        strict.apply_chat_template([{"role": "wizard", "content": "x"}], add_generation_prompt=False)
