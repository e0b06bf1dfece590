"""StreamInterval: a streaming request's outputs are held and merged, never its first text or its end."""

from __future__ import annotations

from services.engine.outputs import RequestOutput
from services.engine.serve.async_engine import StreamInterval


def out(rid: str, text: str, ids: tuple[int, ...], n_out: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, text, ids, finish, 10, 0, n_out)


def test_zero_interval_passes_every_output_through() -> None:
    interval = StreamInterval(0.0)
    outputs = [out("a", "x", (1,), 1), out("b", "y", (2,), 1)]
    assert interval.release(outputs, 0.0) is outputs
    assert interval.release([out("a", "z", (3,), 2)], 0.0001) == [out("a", "z", (3,), 2)]


def test_first_text_goes_at_once_then_tokens_are_held_and_merged_until_the_interval() -> None:
    interval = StreamInterval(0.020)
    assert interval.release([out("a", "He", (1,), 1)], 1.000) == [out("a", "He", (1,), 1)]
    assert interval.release([out("a", "ll", (2,), 2)], 1.005) == []
    assert interval.release([out("a", "o", (3,), 3)], 1.010) == []
    # 20 ms after the first of them was held, the held outputs come out as one, with the later counters.
    released = interval.release([out("a", " w", (4,), 4)], 1.030)
    assert released == [out("a", "llo w", (2, 3, 4), 4)]
    assert interval.release([out("a", "o", (5,), 5)], 1.035) == []
    assert interval.release([out("a", "rld", (6,), 6)], 1.045) == []
    assert interval.release([out("a", "!", (7,), 7)], 1.054) == []
    assert interval.release([out("a", "?", (8,), 8)], 1.056) == [out("a", "orld!?", (5, 6, 7, 8), 8)]


def test_outputs_without_text_do_not_start_the_hold() -> None:
    # A byte-level tokenizer may hold back a partial character: the first *text* is what the client waits
    # for, so outputs are released until some text went out.
    interval = StreamInterval(0.020)
    assert interval.release([out("a", "", (1,), 1)], 1.000) == [out("a", "", (1,), 1)]
    assert interval.release([out("a", "é", (2,), 2)], 1.001) == [out("a", "é", (2,), 2)]
    assert interval.release([out("a", "t", (3,), 3)], 1.002) == []


def test_the_end_is_never_held_and_carries_what_was_held() -> None:
    interval = StreamInterval(0.020)
    interval.release([out("a", "a", (1,), 1)], 1.000)
    assert interval.release([out("a", "b", (2,), 2)], 1.001) == []
    assert interval.release([out("a", "c", (3,), 3, "length")], 1.002) == [out("a", "bc", (2, 3), 3, "length")]
    # An abort (empty, finished) of a held request also flushes what was held.
    interval.release([out("b", "a", (1,), 1)], 1.003)
    assert interval.release([out("b", "b", (2,), 2)], 1.004) == []
    assert interval.release([out("b", "", (), 2, "abort")], 1.005) == [out("b", "b", (2,), 2, "abort")]
    # Nothing is left behind for finished requests.
    assert interval.release([], 5.0) == []


def test_one_clock_for_all_requests() -> None:
    interval = StreamInterval(0.020)
    interval.release([out("a", "a", (1,), 1), out("b", "b", (1,), 1)], 1.000)
    assert interval.release([out("a", "a2", (2,), 2), out("b", "b2", (2,), 2)], 1.010) == []
    assert interval.release([out("a", "a3", (3,), 3)], 1.025) == []
    released = interval.release([], 1.030)
    assert sorted(released, key=lambda o: o.request_id) == [out("a", "a2a3", (2, 3), 3), out("b", "b2", (2,), 2)]


def test_held_outputs_keep_their_logprobs_in_order() -> None:
    from dataclasses import replace

    from services.engine.model.sampler import TokenLogprobs

    def lp(token: int) -> TokenLogprobs:
        return TokenLogprobs(token, -0.1 * token, ((token, -0.1 * token),))

    interval = StreamInterval(0.020)
    interval.release([replace(out("a", "x", (1,), 1), logprobs=(lp(1),))], 1.000)
    assert interval.release([replace(out("a", "y", (2,), 2), logprobs=(lp(2),))], 1.001) == []
    released = interval.release([replace(out("a", "z", (3,), 3, "length"), logprobs=(lp(3),))], 1.002)
    assert released[0].token_ids == (2, 3) and released[0].logprobs == (lp(2), lp(3))


def test_steps_queued_behind_a_busy_pipe_go_as_one_message_in_order() -> None:
    import multiprocessing
    import pickle

    from services.engine.serve.process_engine import _Added, _merge_steps, _PipeWriter, _Step

    snapshots = [object(), object(), object()]
    batch = [_Step([out("a", "x", (1,), 1)], snapshots[0], False), _Step([out("b", "y", (2,), 1)], snapshots[1], True),
             _Added("c", None), _Step([out("a", "z", (3,), 2)], snapshots[2], False)]
    merged = _merge_steps(batch)  # type: ignore[arg-type]
    assert merged[0] == _Step([out("a", "x", (1,), 1), out("b", "y", (2,), 1)], snapshots[1], True)
    assert merged[1:] == batch[2:]  # an other message keeps its place between steps
    # through a real pipe: whatever is sent arrives, in order, however it was batched
    reader, writer_end = multiprocessing.Pipe(duplex=False)
    writer = _PipeWriter(writer_end, "test-writer")
    for i in range(200):
        writer.put(_Step([out("a", str(i), (i,), i + 1)], None, False))  # type: ignore[arg-type]
    writer.close()
    received = []
    while reader.poll():  # close() returned: everything is written
        received += pickle.loads(reader.recv_bytes()).outputs
    assert [o.text for o in received] == [str(i) for i in range(200)]
