"""Presence, frequency and repetition penalties: the sampler's arithmetic on hand-made logits, and the
engine's greedy tokens equal a reference that applies the same penalties to transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.core.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.engine.errors import InvalidParameterError
from services.engine.model.sampler import History, Sampler, apply_penalties
from services.engine.spec.spec_decode import SpecConfig
from services.engine.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.engine.model_helpers import hf_logits, hf_model


def test_the_penalties_arithmetic() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)]
    out = apply_penalties(logits.clone(), params, [History([4], [0, 0, 1])])
    # repetition over prompt {4} and output {0, 1}: 2 -> 1, -1 -> -2, 1 -> 0.5; then frequency x count
    # and presence once for output tokens 0 (twice) and 1 (once).
    expected = torch.tensor([[1.0 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 0.5, 3.0, 0.5]])
    assert torch.allclose(out, expected)
    # A row without penalties is untouched, and so are the logits the caller passed in.
    two = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    plain = SamplingParams(temperature=0.0)
    assert Sampler().sample(two, [plain, SamplingParams(temperature=0.0, frequency_penalty=2.0)], [None, None],
                            [None, History([], [1])])[0] == [1, 0]
    assert torch.equal(two, torch.tensor([[1.0, 2.0], [1.0, 2.0]]))


def test_out_of_range_penalties_are_refused() -> None:
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0.0)):
        with pytest.raises(InvalidParameterError):
            SamplingParams(**bad).validate()  # type: ignore[arg-type]


def reference(hf: torch.nn.Module, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(hf, prompt + out)[-1:].clone()
        out.append(int(apply_penalties(logits, [params], [History(prompt, out)]).argmax()))
    return out


@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", num_draft_tokens=3)])
def test_greedy_tokens_with_penalties_match_the_reference(tmp_path: Path, spec: SpecConfig | None) -> None:
    model = write_tiny_checkpoint(tmp_path / "m", arch="qwen3")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12]]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                             presence_penalty=0.5),
              SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)]
    core = EngineCore(EngineConfig(model_path=model, kv_capacity_tokens=512, block_size=4, max_concurrency=2,
                                   spec=spec or SpecConfig()))
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"r{i}", prompt, p, 0.0)
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    while core.has_unfinished_requests():
        for out in core.step(lambda: 0.0):
            tokens[out.request_id] += out.token_ids
    hf = hf_model(model)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert tokens[f"r{i}"] == reference(hf, prompt, 14, p)
    unpenalised = reference(hf, prompts[0], 14, SamplingParams(temperature=0.0))
    assert tokens["r0"] != unpenalised  # the penalty changed what greedy picks (else the test proves nothing)
    if spec is not None:
        assert core.spec_counters is not None and core.spec_counters.snapshot().num_drafts == 0


def test_min_tokens_bans_the_stop_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4)] * 2
    histories = [History([9], [1], stop_ids=(0,)), History([9], [1, 1], stop_ids=(0,))]
    assert Sampler().sample(logits, params, [None, None], histories)[0] == [1, 0]  # banned, then allowed


def test_min_tokens_holds_off_eos_and_stop_strings_in_the_engine(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "m", arch="qwen3")
    core = EngineCore(EngineConfig(model_path=model, kv_capacity_tokens=512, block_size=4, max_concurrency=2))
    prompt = [5, 6, 7, 8]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = [t for o in _run(core, prompt, plain) for t in o.token_ids]
    text = core.tokenizer.decode(first)
    # The greedy reply's own tokens as stop token ids and its first characters as a stop string: without
    # min_tokens they end it at once; with min_tokens=6 it runs to at least 6 tokens.
    stop_early = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(first[1],), stop=(text[:1],))
    assert len([t for o in _run(core, prompt, stop_early) for t in o.token_ids]) <= 2
    held = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(first[1],), stop=(text[:1],), min_tokens=6)
    outputs = _run(core, prompt, held)
    tokens = [t for o in outputs for t in o.token_ids]
    assert len(tokens) >= 6 and first[1] not in tokens[:6]
    with pytest.raises(InvalidParameterError):
        SamplingParams(max_tokens=4, min_tokens=5).validate()


def _run(core: EngineCore, prompt: list[int], params: SamplingParams) -> list:  # type: ignore[type-arg]
    rid = f"r{core.admitted_total}"
    core.add_request(rid, prompt, params, 0.0)
    outputs = []
    while core.has_unfinished_requests():
        outputs += [o for o in core.step(lambda: 0.0) if o.request_id == rid]
    return outputs
