"""Structured outputs over ninfer-serve's HTTP face with the official openai client (docs/openai_api.md).

The tiny random-weight model writes garbage, so every check is "the reply parses / matches": it fails if
the constraint is dropped anywhere between the client and the sampler.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from enum import StrEnum
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field, create_model

from tests.integration.test_ninfer_serve import client, serve

MESSAGES: Any = [{"role": "user", "content": "answer in JSON"}]


class Colour(StrEnum):
    red = "red"
    green = "green"


def random_model(rng: random.Random, name: str, depth: int = 0) -> type[BaseModel]:
    """A pydantic model with 1..4 fields drawn from enums, bounded integers and numbers, booleans, short
    arrays, patterned strings and (one level down) nested objects."""
    fields: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kinds = ["enum", "int", "number", "bool", "array", "pattern"] + (["nested"] if depth == 0 else [])
        kind = rng.choice(kinds)
        if kind == "enum":
            fields[f"f{i}"] = (Colour, ...)
        elif kind == "int":
            lo = rng.randint(-50, 50)
            fields[f"f{i}"] = (int, Field(ge=lo, le=lo + rng.randint(0, 100)))
        elif kind == "number":
            fields[f"f{i}"] = (float, Field(ge=0, le=10))
        elif kind == "bool":
            fields[f"f{i}"] = (bool, ...)
        elif kind == "array":
            fields[f"f{i}"] = (list[int], Field(max_length=3))
        elif kind == "pattern":
            fields[f"f{i}"] = (str, Field(pattern=r"^[a-z]{1,5}$"))
        else:
            fields[f"f{i}"] = (random_model(rng, f"{name}Inner{i}", depth + 1), ...)
    model: type[BaseModel] = create_model(name, **fields)
    return model


async def test_parse_returns_an_instance_for_20_random_pydantic_schemas(tiny_model: Path, tmp_path: Path) -> None:
    rng = random.Random(26)
    models = [random_model(rng, f"Schema{i}") for i in range(20)]
    async with serve(tiny_model, tmp_path, max_concurrency=8, max_pending_requests=32) as s:
        c = client(s.url)

        async def one(i: int, model: type[BaseModel]) -> BaseModel:
            done = await c.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=model,
                                                  max_tokens=600, seed=i)
            parsed = done.choices[0].message.parsed
            assert parsed is not None and done.choices[0].finish_reason == "stop"
            return parsed

        got = await asyncio.gather(*(one(i, m) for i, m in enumerate(models)))
        assert [type(g) for g in got] == models
        # the 20 schemas compiled once each; asking again is a cache hit
        grammars = s.service.core.grammars  # type: ignore[attr-defined]
        misses = grammars.num_misses
        await one(0, models[0])
        assert grammars.num_misses == misses


async def test_json_object_always_parses_and_choice_and_regex_hold(tiny_model: Path, tmp_path: Path) -> None:
    async with serve(tiny_model, tmp_path, max_concurrency=8, max_pending_requests=64) as s:
        c = client(s.url)

        async def obj(i: int) -> bool:
            r = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1500, seed=i,
                                                response_format={"type": "json_object"})
            content = r.choices[0].message.content or ""
            if r.choices[0].finish_reason == "length":
                # any JSON object is allowed, so a random model may nest or write a string for ever:
                # max_tokens cuts it, and what came is an object's start
                assert content.startswith("{")
                return False
            assert isinstance(json.loads(content), dict)  # finished: it parses, every time
            return True

        finished = await asyncio.gather(*(obj(i) for i in range(8)))
        assert sum(finished) >= 4
        choices = await asyncio.gather(*(c.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=10, seed=i, extra_body={"guided_choice": ["left", "right"]})
            for i in range(20)))
        assert {r.choices[0].message.content for r in choices} <= {"left", "right"}
        regex = await asyncio.gather(*(c.completions.create(
            model="tiny", prompt="id:", max_tokens=20, seed=i, extra_body={"guided_regex": r"[A-Z][0-9]{2}"})
            for i in range(20)))
        assert all(re.fullmatch(r"[A-Z][0-9]{2}", r.choices[0].text) for r in regex)
        # streamed: the deltas of a constrained reply join into a match as well
        stream = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, stream=True,
                                                 extra_body={"structured_outputs": {"regex": "[xy]{5}"}})
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert re.fullmatch("[xy]{5}", text)


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "(unclosed"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_choice": "not a list"}, "guided_choice"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
])
async def test_a_constraint_that_cannot_be_compiled_is_a_400(tiny_model: Path, tmp_path: Path,
                                                             extra: dict[str, Any], param: str) -> None:
    async with serve(tiny_model, tmp_path) as s:
        with pytest.raises(openai.BadRequestError) as err:
            await client(s.url).chat.completions.create(model="tiny", messages=MESSAGES, extra_body=extra)
        assert err.value.body["param"] == param  # type: ignore[index]
