"""The wire contract: message types, subject/stream/bucket names, codec. Imports no service.

Every service imports ``proto``; no service imports another service. Bus payloads are msgpack
encoded with msgspec. Schemas evolve by appending fields with defaults; a field's type never changes;
unknown fields are ignored on decode so an older reader tolerates a newer writer.
"""

from proto.codec import ProtoDecodeError, decode, encode
from proto.messages import (
    PROTOCOL_VERSION,
    ChatMessage,
    EnergyReading,
    EnergySample,
    ErrorInfo,
    GenerateRequest,
    KeyEnergyQuery,
    KeyEnergyReply,
    LimitCounters,
    RequestTokens,
    SlotHeartbeat,
    Timings,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
    UsageRecord,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ChatMessage",
    "EnergyReading",
    "EnergySample",
    "ErrorInfo",
    "GenerateRequest",
    "KeyEnergyQuery",
    "KeyEnergyReply",
    "LimitCounters",
    "ProtoDecodeError",
    "RequestTokens",
    "SlotHeartbeat",
    "Timings",
    "TokenChunk",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "UsageRecord",
    "decode",
    "encode",
]
