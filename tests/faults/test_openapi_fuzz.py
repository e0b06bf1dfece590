"""Issue #25: schemathesis over every route of each service's own ``/openapi.json`` (gateway, accounting,
ninfer-serve), positive and negative cases, with and without a key, bounded in time.

Property: no 5xx except a 503 the route documents (no member / engine / key check can answer now) and the
documented 504; every error body is an OpenAI error ``{"error": {"message", "type", "param", "code"}}``;
no traceback. Also: each document lists exactly the routes its app serves. Budget: the whole file runs in
under 3 minutes on 2 cores (EXAMPLES per operation and mode; measured in docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from services.accounting import openapi as accounting_openapi
from services.accounting.service import AccountingConfig, AccountingService
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.serve import openapi as engine_openapi
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.energy import UnavailableMeter
from services.engine.serve.http import EngineService, ServeConfig, http_site
from services.gateway import openapi as gateway_openapi
from tests.faults.fuzz import is_openai_error
from tests.faults.threaded import ThreadedGateway, in_thread, threaded_gateway

EXAMPLES = 25  # per operation and generation mode
ENGINE_KEY = "sk-engine-fuzz"
SEEN: dict[str, dict[str, int]] = {}


@contextlib.contextmanager
def threaded_engine(model: Path) -> Iterator[str]:
    """ninfer-serve's HTTP face (in-process core) on its own loop in a thread, with an API key."""
    @contextlib.asynccontextmanager
    async def serve() -> AsyncIterator[str]:
        core = EngineCore(EngineConfig(model_path=model, model_id="tiny", kv_capacity_tokens=1024,
                                       max_context=128, max_concurrency=2, max_pending_requests=4))
        async with AsyncEngine(core) as engine:
            service = EngineService(engine, UnavailableMeter("cpu", "test"),
                                    ServeConfig(port=0, api_key=ENGINE_KEY, max_body_bytes=64 * 1024))
            async with http_site(service) as url:
                yield url

    with in_thread(serve, "engine", start_timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def tg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedGateway]:
    with threaded_gateway(Path(tmp_path_factory.mktemp("openapi-fuzz")), with_accounting=True) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    with threaded_engine(tiny_model) as url:
        yield url


def _documented_5xx(doc: dict[str, Any], path: str, method: str) -> set[int]:
    return {int(code) for code in doc["paths"][path][method]["responses"] if code.startswith("5")}


def fuzz_document(doc: dict[str, Any], base_url: str, key: str, budget_s: float) -> dict[str, int]:
    """Every operation of ``doc``, positive and negative, authed or not: the property above. Returns the
    number of answers per status class, for the figures line."""
    schema = schemathesis.openapi.from_dict(doc)
    tally: dict[str, int] = {}
    deadline = time.monotonic() + budget_s
    for result in schema.get_all_operations():
        operation = result.ok()
        method, path = operation.method.lower(), operation.path
        allowed_5xx = _documented_5xx(doc, path, method)
        strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                             operation.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=strategy, authed=st.booleans())
        def run(case: Any, authed: bool) -> None:
            if time.monotonic() > deadline:
                return
            headers = {"Authorization": f"Bearer {key}"} if authed else {}
            resp = case.call(base_url=base_url, headers=headers, timeout=30)
            status = resp.status_code
            tally[f"{status // 100}xx"] = tally.get(f"{status // 100}xx", 0) + 1
            where = (method.upper(), path, str(resp.request.url)[:200], status, resp.content[:300])
            assert status < 500 or status in allowed_5xx, where
            assert b"Traceback" not in resp.content, where
            if status >= 400:
                content_type = (resp.headers.get("content-type") or [""])[0]
                assert content_type.startswith("application/json"), where
                assert is_openai_error(json.loads(resp.content)), where

        run()
    return tally


def test_gateway_routes_never_answer_an_undocumented_5xx(tg: ThreadedGateway) -> None:
    SEEN["gateway"] = fuzz_document(gateway_openapi.document(), tg.url, tg.gw.api_key, 50)


def test_accounting_routes_never_answer_an_undocumented_5xx(tg: ThreadedGateway) -> None:
    assert tg.accounting_url is not None
    SEEN["accounting"] = fuzz_document(accounting_openapi.document(), tg.accounting_url, tg.gw.api_key, 30)


def test_engine_routes_never_answer_an_undocumented_5xx(engine_url: str) -> None:
    SEEN["engine"] = fuzz_document(engine_openapi.document(), engine_url, ENGINE_KEY, 50)
    print(f"\nFIGURES openapi-fuzz: answers={SEEN}")


def _served(routes: Any) -> dict[str, set[str]]:
    served: dict[str, set[str]] = {}
    for route in routes:
        path = route.resource.canonical if route.resource is not None else ""
        if route.method != "HEAD":
            served.setdefault(path, set()).add(route.method.lower())
    return served


def test_the_engine_and_accounting_documents_list_exactly_the_routes_they_serve(tmp_path: Path, tiny_model: Path
                                                                                ) -> None:
    core = EngineCore(EngineConfig(model_path=tiny_model, model_id="tiny", kv_capacity_tokens=256))
    service = EngineService(AsyncEngine(core), UnavailableMeter("cpu", "test"), ServeConfig(port=0))
    documented = {p: set(ops) for p, ops in engine_openapi.document()["paths"].items()}
    assert documented == _served(service.app().router.routes())
    accounting = AccountingService(None, AccountingConfig(db_path=tmp_path / "l.duckdb"))  # type: ignore[arg-type]
    documented = {p: set(ops) for p, ops in accounting_openapi.document()["paths"].items()}
    assert documented == _served(accounting.app().router.routes())
