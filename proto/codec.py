"""msgpack codec. Decoders are built once at import; a malformed payload raises ProtoDecodeError."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from proto import messages as m

T = TypeVar("T", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in (
        m.GenerateRequest,
        m.TokenChunk,
        m.SlotHeartbeat,
        m.EnergySample,
        m.UsageRecord,
        m.LimitCounters,
        m.KeyEnergyQuery,
        m.KeyEnergyReply,
    )
}


class ProtoDecodeError(ValueError):
    """A bus payload that does not decode as the expected message type."""

    def __init__(self, type_name: str, reason: str) -> None:
        super().__init__(f"malformed {type_name}: {reason}")
        self.type_name = type_name
        self.reason = reason


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, cls: type[T]) -> T:
    decoder = _decoders.get(cls)
    if decoder is None:
        decoder = _decoders.setdefault(cls, msgspec.msgpack.Decoder(cls))
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtoDecodeError(cls.__name__, str(exc)) from exc
