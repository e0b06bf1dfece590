"""/v1/embeddings on our engine: its HTTP face, its bus face through the gateway, and the ledger row.

The reference is transformers' eager forward of the same tiny checkpoint (float32, CPU): the last layer's
hidden states (``hidden_states[-1]``, after the final norm, as vLLM pools them), pooled and L2-normalised
in torch. Our model's hidden states agree with transformers' to ~1e-6 (tests/unit/engine/
test_model_equivalence.py: logits to 1e-5), so the vectors are compared at atol 1e-4.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from aiohttp import web
from nats.aio.client import Client

from proto import EmbedReply, EmbedRequest, SlotHeartbeat, decode, encode, subjects
from proto import pools as pool_config
from services.common.http import serving
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.model.tokenizer import Tokenizer
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.energy import UnavailableMeter
from services.engine.serve.http import EngineService, ServeConfig, http_site
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import Stack, wait_for
from tests.unit.engine.model_helpers import hf_model

ATOL = 1e-4
TEXTS = ["the quick brown fox", "hello there, general", "a"]


@contextlib.asynccontextmanager
async def engine_url(model: Path, **settings: object) -> AsyncIterator[str]:
    core = EngineCore(EngineConfig(model_path=model, model_id="tiny", kv_capacity_tokens=1024, max_context=64,
                                   **settings))  # type: ignore[arg-type]
    async with AsyncEngine(core) as engine:
        service = EngineService(engine, UnavailableMeter("cpu", "test"), ServeConfig(port=0), worker_id="w1")
        async with http_site(service) as url:
            yield url


@torch.no_grad()
def reference(model: Path, ids: list[int], pooling: str) -> np.ndarray:
    hidden = hf_model(model)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return F.normalize(vector, dim=0).numpy()


def client(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_engine_embeddings_match_a_torch_reference_in_float_and_base64(tiny_model: Path, pooling: str) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model)
    async with engine_url(tiny_model, pooling=pooling) as url:
        c = client(url)
        as_floats = await c.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
        # the SDK's default asks for base64 and decodes it as little-endian float32 with numpy
        as_base64 = await c.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in as_floats.data] == [0, 1, 2]
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert as_floats.usage.prompt_tokens == sum(len(i) for i in ids) == as_base64.usage.prompt_tokens
    for text_ids, f, b in zip(ids, as_floats.data, as_base64.data, strict=True):
        want = reference(tiny_model, text_ids, pooling)
        got = np.asarray(f.embedding, dtype=np.float32)
        assert got.shape == want.shape == (64,)
        np.testing.assert_allclose(got, want, atol=ATOL)
        np.testing.assert_array_equal(np.asarray(b.embedding, dtype=np.float32), got)  # the same float32 bits
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5


async def test_engine_takes_token_ids_and_lists_of_them_and_refuses_what_it_cannot_do(tiny_model: Path) -> None:
    async with engine_url(tiny_model) as url:
        c = client(url)
        one = await c.embeddings.create(model="tiny", input=[5, 6, 7], encoding_format="float")
        many = await c.embeddings.create(model="tiny", input=[[5, 6, 7], [8, 9]], encoding_format="float")
        assert one.usage.prompt_tokens == 3 and many.usage.prompt_tokens == 3 + 2
        # batched with another input, the products' summation order differs (measured 1.8e-7): not bit-equal
        np.testing.assert_allclose(one.data[0].embedding, many.data[0].embedding, atol=1e-6)
        np.testing.assert_allclose(many.data[1].embedding, reference(tiny_model, [8, 9], "last"), atol=ATOL)
        with pytest.raises(openai.BadRequestError) as too_long:
            await c.embeddings.create(model="tiny", input=[1] * 65)  # max_context 64
        assert too_long.value.code == "context_length_exceeded"
        assert too_long.value.body["param"] == "input"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as dims:
            await c.embeddings.create(model="tiny", input="hi", dimensions=8)
        assert dims.value.body["param"] == "dimensions"  # type: ignore[index]
        same = await c.embeddings.create(model="tiny", input="hi", dimensions=64, encoding_format="float")
        assert len(same.data[0].embedding) == 64  # its own size is no truncation: accepted
        with pytest.raises(openai.BadRequestError) as bad_id:
            await c.embeddings.create(model="tiny", input=[10**6])
        assert bad_id.value.body["param"] == "input"  # type: ignore[index]
        for body in ({"input": []}, {"input": ""}, {"input": [["a"]]}, {"input": "x", "encoding_format": "int8"},
                     {"input": "x", "truncate_prompt_tokens": 3}):
            with pytest.raises(openai.BadRequestError):
                await c.post("/embeddings", body={"model": "tiny", **body}, cast_to=object)
        with pytest.raises(openai.NotFoundError):
            await c.embeddings.create(model="other", input="hi")


async def test_gateway_embeds_on_a_bus_member_and_the_ledger_gets_the_usage_row(stack: Stack, tiny_model: Path
                                                                                ) -> None:
    c = client(stack.base_url, stack.api_key)
    via_gateway = await c.embeddings.create(model="tiny", input=["hello there", "bye"], encoding_format="float")
    assert via_gateway.model == "tiny" and len(via_gateway.data) == 2
    ids = Tokenizer.from_dir(tiny_model).encode("hello there")
    np.testing.assert_allclose(via_gateway.data[0].embedding, reference(tiny_model, ids, "last"), atol=ATOL)
    b64 = await c.embeddings.create(model="tiny", input="hello there")
    raw = np.frombuffer(base64.b64decode(str(await _raw_base64(c))), dtype="<f4")
    np.testing.assert_array_equal(np.asarray(b64.data[0].embedding, dtype=np.float32), raw)
    await wait_for(lambda: stack.accounting.stats.usage_ingested >= 3)
    _cols, rows = await asyncio.wrap_future(stack.accounting.ledger.submit(
        lambda led: led.query("select worker_id, status, prompt_tokens, output_tokens from requests "
                              "order by prompt_tokens desc")))
    assert rows[0] == ("w1", "ok", via_gateway.usage.prompt_tokens, 0)
    assert via_gateway.usage.prompt_tokens > len(ids)
    with pytest.raises(openai.BadRequestError) as too_long:
        await c.embeddings.create(model="tiny", input=[1] * 5000)
    assert too_long.value.code == "context_length_exceeded"


async def _raw_base64(c: openai.AsyncOpenAI) -> str:
    body = await c.post("/embeddings", body={"model": "tiny", "input": "hello there", "encoding_format": "base64"},
                        cast_to=object)
    return body["data"][0]["embedding"]  # type: ignore[index, no-any-return]


async def test_a_bus_member_without_embeddings_is_a_400_naming_it_not_a_503(stack: Stack) -> None:
    """An engine from before embeddings heartbeats and serves generate, but nobody answers its embed subject."""
    nc = stack.worker.nc
    real = stack.worker.heartbeat()
    old = SlotHeartbeat(**{**{f: getattr(real, f) for f in real.__struct_fields__}, "worker_id": "w-old"})

    async def beat() -> None:
        while True:
            await nc.publish(subjects.heartbeat("w-old"), encode(old))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    try:
        await wait_for(lambda: stack.gateway.fleet.record("w-old").heartbeat is not None)
        stack.worker._state = "draining"  # w1 refuses new work: only w-old is left to try
        await stack.worker._publish_heartbeat()
        await wait_for(lambda: (hb := stack.gateway.fleet.record("w1").heartbeat) is not None
                       and hb.state == "draining")
        c = client(stack.base_url, stack.api_key)
        with pytest.raises(openai.BadRequestError) as refused:
            await c.embeddings.create(model="tiny", input="hi")
        assert refused.value.code == "model_not_supported"
        assert "w-old" in refused.value.message
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_bus_face_answers_an_embed_request_directly(stack: Stack) -> None:
    reply = decode((await stack.worker.nc.request(subjects.embed("w1"), encode(EmbedRequest(
        request_id="r1", model="tiny", token_ids=[[1, 2, 3]])), timeout=10)).data, EmbedReply)
    assert reply.error is None and len(reply.embeddings) == 1 and len(reply.embeddings[0]) == 64 * 4
    assert reply.usage is not None and reply.usage.prompt_tokens == 3


# llama.cpp started without --embeddings answers this (tools/server/server.cpp, ERROR_TYPE_NOT_SUPPORTED → 501)
LLAMACPP_NO_EMBEDDINGS = {"error": {"code": 501, "type": "not_supported_error",
                                    "message": "This server does not support embeddings. Start it with `--embeddings`"}}


async def test_an_http_member_without_embeddings_is_a_400_naming_it_and_one_with_them_serves(
        nc: Client, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    async def no_embeddings(request: web.Request) -> web.Response:
        return web.json_response(LLAMACPP_NO_EMBEDDINGS, status=501)

    async def embeddings(request: web.Request) -> web.Response:  # as vLLM answers (one 2-float vector)
        seen.append(await request.json())
        return web.json_response({"object": "list", "model": "tiny", "data": [
            {"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
            "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    async with contextlib.AsyncExitStack() as es:
        apps = []
        for handler in (no_embeddings, embeddings):
            app = web.Application()
            app.router.add_post("/v1/embeddings", handler)
            apps.append(await es.enter_async_context(serving(app, "127.0.0.1", 0)))
        pools = tmp_path / "pools.json"
        pools.write_text(json.dumps({"model_pools": {
            "plain": {"members": [{"model_id": "tiny", "backend": apps[0]}]},
            "both": {"members": [{"model_id": "tiny", "backend": apps[0], "capacity_weight": 8},
                                 {"model_id": "tiny", "backend": apps[1], "capacity_weight": 1}]}}}))
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path),
                                 pool_config.load(pools))
        await es.enter_async_context(gateway.running())
        base = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        assert gateway.bootstrap is not None
        c = client(base, gateway.bootstrap[1])
        with pytest.raises(openai.BadRequestError) as refused:
            await c.embeddings.create(model="plain", input="hi")
        assert refused.value.code == "model_not_supported"
        assert pool_config.member_id_for(apps[0]) in refused.value.message
        # a pool with a member that embeds: the one that cannot is passed over, the body goes as it came
        served = await c.embeddings.create(model="both", input="hi", encoding_format="float",
                                           extra_body={"truncate_prompt_tokens": 1})
        assert served.data[0].embedding == [0.6, 0.8] and served.usage.prompt_tokens == 2
        assert seen[-1]["truncate_prompt_tokens"] == 1


async def test_vectors_over_the_bus_payload_limit_are_a_413_saying_so_not_a_timeout(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    # the server's limit as the worker's client reads it (nats-server's INFO max_payload), lowered to 4 KiB
    monkeypatch.setattr(type(stack.worker.nc), "max_payload", property(lambda _self: 4096))
    c = client(stack.base_url, stack.api_key)
    with pytest.raises(openai.APIStatusError) as refused:
        await c.embeddings.create(model="tiny", input=[[5, 6]] * 40)  # 40 vectors x 256 bytes
    assert refused.value.status_code == 413 and refused.value.code == "too_many_inputs"
    assert len((await c.embeddings.create(model="tiny", input=[[5, 6]] * 8)).data) == 8  # 2 KiB fits
