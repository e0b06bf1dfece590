"""Pure: a member's lane count when its engine does not say, and where the number came from.

vLLM does not export ``max_num_seqs`` (upstream's ``vllm:cache_config_info`` carries the CacheConfig:
``block_size``, ``num_gpu_blocks``, ``cache_dtype`` ...; the scheduler's limit is elsewhere), and a llama.cpp
or SGLang build may answer neither ``/slots``, ``/props`` nor server info. Lanes, first that applies
(docs/telemetry.md, "Lanes"):

1. the engine's own figure (``cache_config_info{max_num_seqs}``, ``/slots``, ``/props``, SGLang's metrics or
   server info): the normaliser already filled it, with its source;
2. ``declared``: the operator's (``--lanes ID=N``, else the pools file's member ``max_seqs``, else
   ``metrics.backend_max_seqs`` by backend URL);
3. ``learned``: the largest ``running`` seen while ``waiting > 0`` — a continuous-batching scheduler only
   leaves requests waiting when its running set is full, so that running count is the lane count;
4. ``default``: the pools file's ``metrics.default_max_seqs`` (upstream's default, 3).

For 3 and 4, which are estimates, a ``running`` above the estimate raises it to that count (a member never
reports more running than lanes from a guess), and that floor is kept as learned too. What was learned
belongs to one engine process: it is forgotten when the engine restarts (``process_start_time_seconds``
changes, or its token counter goes backwards) or another kind of engine answers on the member's URL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.telemetry.normalize import Reading

# Kinds whose lanes may come from here; ninfer always reports max_concurrency, stock has nothing to weigh.
ESTIMATED_KINDS = frozenset({"vllm", "llamacpp", "sglang"})


@dataclass(frozen=True)
class LaneMemory:
    """What telemetry has seen of one engine process (the newest reading's restart markers included)."""

    engine_kind: str | None = None
    learned_lanes: int | None = None  # max(running while waiting > 0, running above the estimate)
    process_start_s: float | None = None
    tokens_processed_total: int | None = None


def is_restart(memory: LaneMemory, reading: Reading) -> bool:
    """True when ``reading`` comes from another engine process than the one ``memory`` describes."""
    if memory.engine_kind is not None and memory.engine_kind != reading.engine_kind:
        return True
    if memory.process_start_s is not None and reading.process_start_s is not None \
            and reading.process_start_s != memory.process_start_s:
        return True
    return (memory.tokens_processed_total is not None and reading.tokens_processed_total is not None
            and reading.tokens_processed_total < memory.tokens_processed_total)


def resolve(reading: Reading, memory: LaneMemory, *, declared: int | None, default: int) -> tuple[Reading, LaneMemory]:
    """The reading with ``lanes`` (and ``signal_sources["lanes"]``) filled by the order above, and the
    memory to keep for the next scrape."""
    if is_restart(memory, reading):
        memory = LaneMemory()
    learned = memory.learned_lanes
    running = reading.running
    if running is not None and reading.waiting and running > 0:
        learned = max(learned or 0, running)
    # a marker the reading lacks (a counter absent this once) keeps the last one seen
    memory = LaneMemory(engine_kind=reading.engine_kind, learned_lanes=learned,
                        process_start_s=reading.process_start_s or memory.process_start_s,
                        tokens_processed_total=(reading.tokens_processed_total
                                                if reading.tokens_processed_total is not None
                                                else memory.tokens_processed_total))
    if reading.engine_kind not in ESTIMATED_KINDS or reading.lanes:
        return reading, memory
    if declared:
        lanes, source = declared, "declared"
    elif learned:
        lanes, source = learned, "learned"
    else:
        lanes, source = default, "default"
    if running is not None and running > lanes:  # an estimate below what runs now: the engine has more
        lanes, source = running, "learned"
        memory = replace(memory, learned_lanes=running)
    return replace(reading, lanes=lanes, signal_sources={**reading.signal_sources, "lanes": source}), memory
