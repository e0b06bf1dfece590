"""msgpack and JSON codecs. Decoders are built once at import; a malformed payload raises ProtoDecodeError."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from proto import admin, fleet, generate, ledger

T = TypeVar("T", bound=msgspec.Struct)

_STRUCTS = [cls for module in (generate, fleet, ledger, admin) for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__module__ == module.__name__]

_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {cls: msgspec.msgpack.Decoder(cls) for cls in _STRUCTS}
_json_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {cls: msgspec.json.Decoder(cls) for cls in _STRUCTS}


class ProtoDecodeError(ValueError):
    """A bus payload that does not decode as the expected message type.

    ``is_malformed``: the bytes are not msgpack/JSON at all (rather than the wrong shape or types)."""

    def __init__(self, type_name: str, reason: str, is_malformed: bool = False) -> None:
        super().__init__(f"malformed {type_name}: {reason}")
        self.type_name = type_name
        self.reason = reason
        self.is_malformed = is_malformed


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, cls: type[T]) -> T:
    return _decode(_decoders, msgspec.msgpack.Decoder, data, cls)


def _decode(decoders: dict[type[Any], Any], make: Callable[[type[Any]], Any], data: bytes, cls: type[T]) -> T:
    """Decode with the one decoder of ``cls`` (built on first use when not prebuilt); errors as ProtoDecodeError."""
    decoder = decoders.get(cls)
    if decoder is None:
        decoder = decoders.setdefault(cls, make(cls))
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]  # Decoder[Any]: the dict is keyed by cls
    except msgspec.ValidationError as exc:
        raise ProtoDecodeError(cls.__name__, str(exc)) from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtoDecodeError(cls.__name__, str(exc), is_malformed=True) from exc


def encode_json(msg: msgspec.Struct) -> bytes:
    """The JSON form, for the admin link's subjects and the identity bucket (proto/admin.py)."""
    return _json_encoder.encode(msg)


def decode_json(data: bytes, cls: type[T]) -> T:
    return _decode(_json_decoders, msgspec.json.Decoder, data, cls)
