"""Stop strings over streamed deltas: spanning matches, held-back tails, earliest match, flush."""

from __future__ import annotations

import pytest

from services.engine.core.stop_checker import StopChecker, StopScan, scan_stop


def test_a_stop_string_spanning_two_deltas_stops_and_is_never_emitted() -> None:
    checker = StopChecker(["</s>"])
    first = checker.feed("Hello </")
    assert (first.text_to_emit, first.held_back, first.is_stopped) == ("Hello ", "</", False)
    second = checker.feed("s> world")
    assert (second.text_to_emit, second.is_stopped, second.stop_string) == ("", True, "</s>")
    assert checker.feed("more") == StopScan("", "", True)
    assert checker.flush() == ""


def test_a_held_back_tail_is_released_once_it_can_no_longer_match() -> None:
    checker = StopChecker(["abc"])
    assert checker.feed("xab").text_to_emit == "x"
    released = checker.feed("d")
    assert (released.text_to_emit, released.held_back, released.is_stopped) == ("abd", "", False)


def test_a_tail_is_held_for_the_longest_partial_match_over_all_stop_strings() -> None:
    # "...ab" is a prefix of "abcd" (2 chars) and "b" of "bz" (1 char): hold the longer.
    assert scan_stop("", "xxab", ["abcd", "bz"]) == StopScan("xx", "ab", False)


def test_an_overlapping_partial_match_still_finds_the_stop() -> None:
    checker = StopChecker(["aab"])
    assert checker.feed("aa").text_to_emit == ""
    result = checker.feed("ab")  # text "aaab": the match starts at index 1
    assert (result.text_to_emit, result.is_stopped) == ("a", True)


def test_the_earliest_match_wins_over_the_first_listed() -> None:
    result = scan_stop("", "one STOP two END", ["END", "STOP"])
    assert (result.text_to_emit, result.stop_string) == ("one ", "STOP")


def test_a_stop_string_at_the_very_start_emits_nothing() -> None:
    assert scan_stop("", "###rest", ["###"]) == StopScan("", "", True, "###")


def test_text_after_the_stop_in_the_same_delta_is_dropped() -> None:
    result = StopChecker(["\n\n"]).feed("line one\n\nline two")
    assert (result.text_to_emit, result.is_stopped) == ("line one", True)


def test_no_stop_strings_pass_everything_through() -> None:
    checker = StopChecker([])
    assert checker.feed("abc") == StopScan("abc", "", False)
    assert checker.flush() == ""


def test_flush_releases_the_held_tail_when_generation_ends_otherwise() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("the end ST").text_to_emit == "the end "
    assert checker.flush() == "ST"
    assert checker.flush() == ""


def test_emitted_text_plus_held_back_is_always_the_input_until_a_stop() -> None:
    checker = StopChecker(["<|im_end|>", "Observation:"])
    deltas = ["Thought: ", "<|im", "_e", "n", "d", " Obs", "ervation", " <|im_", "end|>", "tail"]
    emitted = ""
    for d in deltas:
        result = checker.feed(d)
        emitted += result.text_to_emit
        if result.is_stopped:
            break
    # "<|im_end" followed by "d " is not "<|im_end|>", so it is released; " Observation" does not match
    # "Observation:"; the real stop arrives split across " <|im_" and "end|>".
    assert emitted == "Thought: <|im_end Observation "
    assert result.is_stopped and result.stop_string == "<|im_end|>"


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError):
        StopChecker([""])
