"""Logprobs: the engine reports, per output token, the model's own log-probability of it and the position's
top-n, equal to transformers' log-softmax at that position; with speculative decoding too (the accepted
tokens' rows of the verification forward), and through token bytes that rebuild the text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.outputs import RequestOutput
from services.engine.serve.frontend import output_chunk
from services.engine.spec.spec_decode import SpecConfig
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.engine.model_helpers import hf_logits, hf_model

PROMPTS = [[5, 17, 300, 42, 99, 7, 8, 200], [9, 10, 11, 12, 9, 10, 11, 12, 9, 10], [100, 101, 102]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lp") / "qwen3", arch="qwen3")


def run(core: EngineCore, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        core.add_request(f"r{i}", prompt, p, 0.0)
    outputs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for out in core.step(lambda: 0.0):
            outputs[out.request_id].append(out)
    return outputs


def core_for(model: Path, spec: SpecConfig | None = None) -> EngineCore:
    return EngineCore(EngineConfig(model_path=model, kv_capacity_tokens=1024, block_size=4, max_concurrency=3,
                                   spec=spec or SpecConfig()))


def test_each_token_s_logprob_and_top_n_are_transformers_log_softmax(model: Path) -> None:
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]  # did not ask
    outputs = run(core_for(model), params)
    assert all(o.logprobs is None for o in outputs["r2"])
    hf = hf_model(model)
    for i, top_n in ((0, 3), (1, 0)):
        tokens = [t for o in outputs[f"r{i}"] for t in o.token_ids]
        entries = [e for o in outputs[f"r{i}"] for e in o.logprobs or ()]
        assert [e.token_id for e in entries] == tokens and len(tokens) == 12
        reference = torch.log_softmax(hf_logits(hf, PROMPTS[i] + tokens), dim=-1)[len(PROMPTS[i]) - 1 : -1]
        for pos, entry in enumerate(entries):
            assert entry.logprob == pytest.approx(reference[pos, entry.token_id].item(), abs=1e-4)
            assert len(entry.top) == top_n
            best = reference[pos].topk(top_n) if top_n else None
            for (tid, lp), ref_lp in zip(entry.top, best.values.tolist() if best else [], strict=True):
                assert lp == pytest.approx(ref_lp, abs=1e-4)
                assert reference[pos, tid].item() == pytest.approx(lp, abs=1e-4)
        if i == 0:  # greedy: the chosen token is the best one
            assert all(e.top[0] == (e.token_id, pytest.approx(e.logprob)) for e in entries)


def test_speculative_decoding_reports_the_same_logprobs(model: Path) -> None:
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2) for _ in PROMPTS]
    plain = run(core_for(model), params)
    spec_core = core_for(model, SpecConfig(method="ngram", num_draft_tokens=3))
    spec = run(spec_core, params)
    assert spec_core.spec_counters is not None and spec_core.spec_counters.snapshot().num_accepted_tokens > 0
    for rid in plain:
        a = [e for o in plain[rid] for e in o.logprobs or ()]
        b = [e for o in spec[rid] for e in o.logprobs or ()]
        assert [e.token_id for e in a] == [e.token_id for e in b] and len(a) == 16
        for x, y in zip(a, b, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_the_rendered_tokens_carry_bytes_that_rebuild_the_text(model: Path) -> None:
    core = core_for(model)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1) for _ in PROMPTS]
    for outputs in run(core, params).values():
        chunks = [output_chunk(core.tokenizer, "r", i, o, "w") for i, o in enumerate(outputs)]
        rendered = [e for c in chunks for e in c.logprobs or ()]
        assert len(rendered) == 20 and all(len(e.top_logprobs) == 1 for e in rendered)
        text = "".join(c.text for c in chunks)
        assert bytes(b for e in rendered for b in e.bytes).decode("utf-8", errors="replace") == text
