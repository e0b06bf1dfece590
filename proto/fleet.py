"""The fleet's link: engines' and telemetry's SlotHeartbeat to the gateways, and one device's EnergyReading."""

from __future__ import annotations

from typing import Literal

from proto.base import Message

EngineKind = Literal["native", "ninfer", "vllm", "llamacpp", "sglang", "stock"]
WorkerState = Literal["ready", "draining", "stopped", "down"]
# "engine_reported": the engine's own figures (an NInfer-class /usage daily Wh), relayed by telemetry
EnergyMethod = Literal["counter", "power_integration", "estimated", "engine_reported", "unavailable"]
# What a member serves beyond plain chat and completions (SlotHeartbeat.capabilities); a str on the wire, so a
# newer engine's new name does not break an older gateway's decoding
CAPABILITY_TOOLS = "tools"  # tools / tool_choice / parallel_tool_calls, tool_calls and tool turns in messages
CAPABILITY_STRUCTURED_OUTPUTS = "structured_outputs"  # response_format, guided_*, structured_outputs
CAPABILITY_EMBEDDINGS = "embeddings"
CAPABILITY_REASONING = "reasoning"  # reasoning_content split out of the reply
CAPABILITY_RESPONSES = "responses"  # /v1/responses on its own HTTP face
CAPABILITY_CHOICES = "choices"  # n > 1, echo and suffix over the bus (GenerateRequest.n / echo / suffix)



class SlotHeartbeat(Message, frozen=True):
    """engine or telemetry → gateways on ``llm.v1.hb.<worker_id>`` and the ``llm_workers`` KV bucket.

    ``admitted_by_gateway`` counts, per gateway id, the requests the engine has accepted since
    ``session_id`` began, so each gateway books only the requests it routed that this heartbeat cannot
    yet reflect (``admitted_total`` is the sum over all gateways and direct HTTP clients).
    """

    worker_id: str
    session_id: str
    seq: int
    ts_s: float
    model_id: str
    engine_kind: EngineKind = "native"
    backend: str = ""
    state: WorkerState = "ready"
    lanes: int | None = None
    running: int | None = None
    waiting: int | None = None
    max_pending: int | None = None
    max_context: int | None = None
    kv_usage: float | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    kv_spills_total: int | None = None
    kv_evictions_total: int | None = None
    preemptions_total: int | None = None
    admitted_total: int | None = None
    prompt_tokens_queried_total: int | None = None
    prompt_tokens_hit_total: int | None = None
    prefill_tok_per_s: float | None = None
    decode_tok_per_s: float | None = None
    energy_today_wh: float | None = None
    heartbeat_interval_s: float | None = None
    admitted_by_gateway: dict[str, int] = {}
    # Appended (a reader older than it ignores the key; a message older than it decodes as None): the
    # engine's own last-30-days figure (NInfer /usage ``energy.rolling_30d.wh``), None where not reported.
    energy_30d_wh: float | None = None
    # Appended: how many tokens the KV cache holds (blocks x block size), so a gateway can bound what its
    # cache-affinity table credits the engine with holding (docs/routing.md §4); None where unknown.
    kv_capacity_tokens: int | None = None
    # Appended: where each load figure came from, field name -> source ("/slots", "/props", "/metrics",
    # "/server_info", "cache_config_info", "declared", "learned", "default", ...; docs/telemetry.md). Telemetry
    # fills it for the members it scrapes; our own engines' bus heartbeats leave it None.
    signal_sources: dict[str, str] | None = None
    # Appended (issue #26): what the member serves beyond plain chat and completions (the CAPABILITY_* names).
    # None: a member that does not say (an engine from before this field, which would silently ignore tools or
    # response_format): the gateway sends it neither (services/gateway/capabilities.py).
    capabilities: list[str] | None = None
    # Appended: how the member's model writes tool calls ("hermes" | "llama3_json": services/common/
    # tool_calls.py), which the gateway's parser of its bus replies follows; None: "hermes"
    tool_call_format: str | None = None


class EnergyReading(Message, frozen=True):
    """One device's raw cumulative counter at sample time. ``energy_mj`` None = unavailable."""

    device_id: str
    kind: Literal["nvml", "rapl", "engine", "estimate", "none"] = "none"
    method: EnergyMethod = "unavailable"
    energy_mj: int | None = None
    max_range_mj: int | None = None
    power_mw: int | None = None
    # Appended: the counter in its native unit where that is finer than mJ (RAPL's energy_uj and
    # max_energy_range_uj). A sender that has them still fills energy_mj/max_range_mj (= uj // 1000) for
    # older readers; a reader takes the µJ delta when both readings of an interval carry energy_uj.
    energy_uj: int | None = None
    max_range_uj: int | None = None


class RouteNote(Message, frozen=True):
    """One route a gateway made, for its replicas (docs/routing.md §6). ``kind`` "routed": a request went to
    ``member_id`` at ``routed_s`` (the replicas book it until the member's heartbeat can hold it, and count its
    queued prefill until "prefill_done"); "first_byte":
    it streamed its first byte there, so the member holds ``prefix`` (each depth's digest, depth and characters,
    as ``services.gateway.affinity.PrefixKey``) and the session ``session_key`` (X-Session-Id only) is there."""

    kind: Literal["routed", "first_byte", "prefill_done"]
    member_id: str
    routed_s: float
    prefix: list[tuple[str, int, int]] = []
    session_key: str | None = None
    # "routed": the prompt characters it queues for prefill there (less the cached prefix expected); "prefill_done"
    # (first byte, or the attempt ended): the same figure taken off again
    pending_chars: int = 0


class RouteNotes(Message, frozen=True):
    """gateway → gateways on ``llm.v1.route.<gateway_id>``: the routes it made since its previous message."""

    gateway_id: str
    session_id: str
    seq: int
    ts_s: float
    notes: list[RouteNote] = []
