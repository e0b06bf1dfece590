import msgspec
import pytest

from proto import (
    ChatMessage,
    EnergyReading,
    EnergySample,
    GenerateRequest,
    ProtoDecodeError,
    SlotHeartbeat,
    TokenChunk,
    Usage,
    UsageRecord,
    decode,
    encode,
    subjects,
)

EXAMPLES = [
    GenerateRequest(request_id="r1", model="m", messages=[ChatMessage(role="user", content="hi")], max_tokens=8,
                    stop=["\n"], seed=3),
    TokenChunk(request_id="r1", index=3, text="héllo", token_ids=[1, 2], finish_reason="stop",
               usage=Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=4)),
    SlotHeartbeat(worker_id="w1", session_id="s", seq=7, ts_s=1.5, model_id="m", lanes=8, running=2, waiting=0,
                  kv_usage=0.25, admitted_by_gateway={"gw": 3}),
    SlotHeartbeat(worker_id="w1", session_id="s", seq=8, ts_s=2.5, model_id="m", engine_kind="ninfer",
                  energy_today_wh=2.5, energy_30d_wh=95.25),
    EnergySample(worker_id="w1", session_id="s", seq=1, ts_s=2.0, model_id="m",
                 readings=[EnergyReading(device_id="GPU-1", kind="nvml", method="counter", energy_mj=123)]),
    UsageRecord(gateway_id="gw", session_id="s", seq=1, ts_s=3.0, request_id="r1", model="m", pool="m",
                prompt_tokens=5, output_tokens=2),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_an_encode_decode_round_trip(message: msgspec.Struct) -> None:
    assert decode(encode(message), type(message)) == message


def test_unknown_fields_from_a_newer_writer_are_ignored() -> None:
    class NewerHeartbeat(msgspec.Struct, kw_only=True):
        worker_id: str
        session_id: str
        seq: int
        ts_s: float
        model_id: str
        some_future_field: list[int]

    data = msgspec.msgpack.encode(NewerHeartbeat(worker_id="w", session_id="s", seq=1, ts_s=0.0, model_id="m",
                                                 some_future_field=[1, 2]))
    hb = decode(data, SlotHeartbeat)
    assert (hb.worker_id, hb.seq, hb.lanes) == ("w", 1, None)


class _HeartbeatBeforeEnergy30d(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SlotHeartbeat as readers and writers knew it before ``energy_30d_wh`` was appended."""

    worker_id: str
    session_id: str
    seq: int
    ts_s: float
    model_id: str
    engine_kind: str = "native"
    energy_today_wh: float | None = None
    admitted_by_gateway: dict[str, int] = {}


def test_energy_30d_wh_was_appended_so_old_readers_and_old_messages_both_still_work() -> None:
    new = SlotHeartbeat(worker_id="w", session_id="s", seq=1, ts_s=0.0, model_id="m", engine_kind="ninfer",
                        energy_today_wh=2.5, energy_30d_wh=95.25)
    old_view = msgspec.msgpack.decode(encode(new), type=_HeartbeatBeforeEnergy30d)  # an old reader ignores it
    assert (old_view.worker_id, old_view.energy_today_wh) == ("w", 2.5)
    old = msgspec.msgpack.encode(_HeartbeatBeforeEnergy30d(worker_id="w", session_id="s", seq=1, ts_s=0.0,
                                                           model_id="m", energy_today_wh=2.5))
    hb = decode(old, SlotHeartbeat)  # a message from an old writer: unknown, not 0
    assert (hb.energy_today_wh, hb.energy_30d_wh) == (2.5, None)
    assert b"energy_30d_wh" not in encode(hb)  # None is the default: not on the wire at all
    names = [f.name for f in msgspec.structs.fields(SlotHeartbeat)]
    assert names.index("energy_30d_wh") > names.index("admitted_by_gateway")  # appended after the old last field


def test_malformed_payloads_raise_a_decode_error_naming_the_type() -> None:
    with pytest.raises(ProtoDecodeError, match="SlotHeartbeat"):
        decode(b"\xff\x00garbage", SlotHeartbeat)
    with pytest.raises(ProtoDecodeError, match="UsageRecord"):
        decode(msgspec.msgpack.encode({"request_id": 5}), UsageRecord)


def test_a_missing_measurement_stays_null_not_zero() -> None:
    hb = decode(encode(SlotHeartbeat(worker_id="w", session_id="s", seq=1, ts_s=0.0, model_id="m")), SlotHeartbeat)
    assert hb.kv_usage is None and hb.running is None and hb.energy_today_wh is None and hb.energy_30d_wh is None
    reading = EnergyReading(device_id="cpu")
    assert reading.energy_mj is None and reading.method == "unavailable"


def test_subjects_are_spelled_in_one_place_and_ids_are_checked() -> None:
    assert subjects.gen("w-1") == "llm.v1.gen.w-1"
    assert subjects.heartbeat("w-1") == "llm.v1.hb.w-1"
    assert subjects.usage("gw") == "llm.v1.usage.gw"
    with pytest.raises(ValueError):
        subjects.check_id("bad.id")
    with pytest.raises(ValueError):
        subjects.check_id("")
