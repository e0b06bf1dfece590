"""Sampler: greedy, top-k, top-p nucleus, seeded reproducibility independent of batch position,
logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.core.sampling_params import SamplingParams
from services.engine.errors import InvalidParameterError
from services.engine.model.sampler import Sampler, apply_top_k_top_p

VOCAB = 50


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax_of_every_row() -> None:
    logits = random_logits(6)
    tokens, logprobs = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs is None


def test_top_k_one_equals_greedy_whatever_the_temperature() -> None:
    logits = random_logits(8, seed=1)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 2.0, 10.0)] * 2
    tokens, _ = Sampler().sample(logits, params, [seeded(i) for i in range(8)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_a_seeded_request_draws_the_same_tokens_in_any_batch_position() -> None:
    sampler = Sampler()
    row = random_logits(1, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    other = SamplingParams(temperature=1.3)

    def draws(batch_before: int, batch_after: int) -> list[int]:
        gen = seeded(42)  # one generator per request, created from its seed, reused across steps
        out = []
        for step in range(20):
            before, after = random_logits(batch_before, 100 + step), random_logits(batch_after, 200 + step)
            logits = torch.cat([before, row, after])
            n = batch_before + 1 + batch_after
            tokens, _ = sampler.sample(
                logits,
                [other] * batch_before + [params] + [other] * batch_after,
                [None] * batch_before + [gen] + [seeded(step)] * batch_after,
            )
            out.append(tokens[batch_before])
            assert len(tokens) == n
        return out

    alone = draws(0, 0)
    assert draws(3, 0) == alone
    assert draws(1, 4) == alone
    assert len(set(alone)) > 1  # the row really is sampled, not argmaxed


def test_different_seeds_give_different_sequences() -> None:
    row = torch.zeros(1, VOCAB)  # uniform
    p = [SamplingParams(temperature=1.0)]
    g1, g2 = seeded(1), seeded(2)
    a = [Sampler().sample(row, p, [g1])[0][0] for _ in range(20)]
    b = [Sampler().sample(row, p, [g2])[0][0] for _ in range(20)]
    assert a != b


def hand_made_logits() -> torch.Tensor:
    # Probabilities 0.5, 0.3, 0.15, 0.05 on tokens 2, 0, 3, 1 (deliberately not in sorted order).
    probs = torch.tensor([[0.3, 0.05, 0.5, 0.15]])
    return probs.log()


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        # Token j (by descending probability) stays iff the mass before it is < top_p.
        (0.45, {2}),  # mass before token 0 is 0.5 >= 0.45
        (0.75, {2, 0}),  # 0.5 < 0.75; before token 3: 0.5 + 0.3 = 0.8 >= 0.75
        (0.9, {2, 0, 3}),  # 0.8 < 0.9; before token 1: 0.5 + 0.3 + 0.15 = 0.95 >= 0.9
        (1.0, {2, 0, 3, 1}),  # off
    ],
)
def test_top_p_keeps_the_minimal_nucleus(top_p: float, kept: set[int]) -> None:
    filtered = apply_top_k_top_p(hand_made_logits(), [0], [top_p])
    assert {i for i in range(4) if filtered[0, i] > float("-inf")} == kept


def test_top_p_keeps_the_most_likely_token_even_below_its_mass() -> None:
    filtered = apply_top_k_top_p(hand_made_logits(), [0], [0.01])
    assert {i for i in range(4) if filtered[0, i] > float("-inf")} == {2}


def test_top_k_then_top_p_renormalises_over_the_top_k() -> None:
    # Top-2 leaves 0.5 and 0.3, renormalised to 0.625 and 0.375; top_p = 0.6 keeps only the first.
    filtered = apply_top_k_top_p(hand_made_logits(), [2], [0.6])
    assert {i for i in range(4) if filtered[0, i] > float("-inf")} == {2}
    filtered = apply_top_k_top_p(hand_made_logits(), [2], [0.7])  # 0.625 < 0.7: both stay
    assert {i for i in range(4) if filtered[0, i] > float("-inf")} == {2, 0}


def test_sampling_with_top_p_only_draws_from_the_nucleus_in_proportion() -> None:
    n = 4000
    logits = hand_made_logits().expand(n, 4).contiguous()
    tokens, _ = Sampler().sample(logits, [SamplingParams(top_p=0.75)] * n, [seeded(7)] + [None] * (n - 1))
    counts = {t: tokens.count(t) for t in set(tokens)}
    assert set(counts) == {2, 0}
    # Within the nucleus, 0.5 / (0.5 + 0.3) = 0.625 of draws are token 2; 4 sigma ~ 0.03 at n = 4000.
    assert abs(counts[2] / n - 0.5 / 0.8) < 0.04


def test_a_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = random_logits(4, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 2
    tokens, _ = Sampler().sample(logits, params, [None, seeded(1), None, seeded(2)])
    argmax = logits.argmax(dim=-1).tolist()
    assert (tokens[0], tokens[2]) == (argmax[0], argmax[2])


def test_logprobs_are_the_raw_log_softmax_with_the_top_n_best_first() -> None:
    logits = hand_made_logits()
    params = [SamplingParams(temperature=0.0, logprobs=2)]
    tokens, logprobs = Sampler().sample(logits, params, [None])
    assert logprobs is not None and logprobs[0] is not None
    lp = logprobs[0]
    assert tokens == [2] and lp.token_id == 2
    assert lp.logprob == pytest.approx(math.log(0.5), abs=1e-6)
    assert [t for t, _ in lp.top] == [2, 0]
    assert [v for _, v in lp.top] == pytest.approx([math.log(0.5), math.log(0.3)], abs=1e-6)


def test_only_rows_that_ask_get_logprobs() -> None:
    logits = random_logits(3, seed=4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0), SamplingParams()]
    _, logprobs = Sampler().sample(logits, params, [None, None, seeded(0)])
    assert logprobs is not None
    assert logprobs[0] is None and logprobs[2] is None
    assert logprobs[1] is not None and logprobs[1].top == ()


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("temperature", SamplingParams(temperature=-0.1)),
        ("top_p", SamplingParams(top_p=0.0)),
        ("top_p", SamplingParams(top_p=1.5)),
        ("top_k", SamplingParams(top_k=-2)),
        ("max_tokens", SamplingParams(max_tokens=0)),
        ("seed", SamplingParams(seed=-1)),
        ("stop", SamplingParams(stop=[""])),
        ("logprobs", SamplingParams(logprobs=21)),
    ],
)
def test_out_of_range_params_name_the_field(field: str, params: SamplingParams) -> None:
    with pytest.raises(InvalidParameterError) as exc:
        params.validate()
    assert exc.value.field == field
    assert isinstance(exc.value, ValueError)


def test_lists_are_frozen_into_tuples() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert (p.stop, p.stop_token_ids) == (("a", "b"), (1, 2))
    assert SamplingParams(stop="x").stop == ("x",)
