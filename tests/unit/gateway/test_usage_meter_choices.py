"""UsageMeter with n > 1 choices (services/gateway/usage_meter.py): each choice's final usage is kept, and
the request's usage is their sum once all have ended: the prompt once, the output summed."""

from __future__ import annotations

from proto import Usage
from services.gateway.usage_meter import UsageMeter


def test_the_choices_finals_sum_into_one_usage_that_counts_the_prompt_once() -> None:
    meter = UsageMeter(num_choices=3)
    meter.accepted(prompt_tokens=125)
    meter.saw_tokens(6 + 6)
    meter.choice_finished(1, Usage(prompt_tokens=125, completion_tokens=6, cached_tokens=112, reasoning_tokens=2))
    meter.choice_finished(0, Usage(prompt_tokens=125, completion_tokens=6, cached_tokens=0, reasoning_tokens=1))
    # two of three ended: not final yet, the gateway's own count stands meanwhile
    assert not meter.is_final
    assert meter.result() == (Usage(prompt_tokens=125, completion_tokens=12), "counted_by_gateway")
    meter.choice_finished(2, Usage(prompt_tokens=125, completion_tokens=4, cached_tokens=112), "engine")
    # choice 0's prompt and cached counts (it prefilled the prompt), 6 + 6 + 4 output, 1 + 2 + 0 reasoning;
    # one choice's count came at an abort: the source says so
    assert meter.result() == (Usage(prompt_tokens=125, completion_tokens=6 + 6 + 4, cached_tokens=0,
                                    reasoning_tokens=1 + 2 + 0), "engine")


def test_one_choice_is_final_at_its_own_end() -> None:
    meter = UsageMeter()
    meter.choice_finished(0, Usage(prompt_tokens=9, completion_tokens=4))
    assert meter.result() == (Usage(prompt_tokens=9, completion_tokens=4), "member")
