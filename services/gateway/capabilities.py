"""Which features a request needs from a bus member, and which of them a member's heartbeat lacks. Pure.

An engine from before issue #26 decodes a GenerateRequest's ``tools`` / ``constraint`` fields as unknown and
ignores them, so it would answer a tool or structured-output request with plain text as if all were well.
Our engines now say in their heartbeat what they serve (``SlotHeartbeat.capabilities``); the forwarder skips
a bus member that lacks what the request needs (another member of the pool may serve it), and when none can,
the answer is a 400 naming the member and the feature (docs/openai_api.md, "Capabilities").
HTTP members are not judged by this: they get the client's body as it came and answer for themselves.
"""

from __future__ import annotations

from proto import GenerateRequest, SlotHeartbeat
from proto.fleet import CAPABILITY_CHOICES, CAPABILITY_REASONING, CAPABILITY_STRUCTURED_OUTPUTS, CAPABILITY_TOOLS

# the request field a missing feature is reported under (the 400's ``param``)
FEATURE_PARAM = {CAPABILITY_TOOLS: "tools", CAPABILITY_STRUCTURED_OUTPUTS: "response_format",
                 CAPABILITY_REASONING: "reasoning_effort", CAPABILITY_CHOICES: "n"}


def required_features(generate: GenerateRequest) -> list[str]:
    """What serving ``generate`` takes beyond plain generation: ``tools`` when tools are offered or the
    messages hold calls or tool results (an older engine drops those fields), ``structured_outputs`` for a
    constraint, ``reasoning`` for a thinking budget or template variables (an older engine would think
    without bound, or with thinking on when the client turned it off)."""
    needed = []
    if generate.tools or any(m.tool_calls or m.tool_call_id is not None for m in generate.messages or ()):
        needed.append(CAPABILITY_TOOLS)
    if generate.constraint is not None:
        needed.append(CAPABILITY_STRUCTURED_OUTPUTS)
    if generate.reasoning_effort is not None or generate.chat_template_kwargs:
        needed.append(CAPABILITY_REASONING)
    if generate.n > 1 or generate.echo or generate.suffix:  # an older engine answers one choice, un-echoed
        needed.append(CAPABILITY_CHOICES)
    return needed


def missing_features(needed: list[str], heartbeat: SlotHeartbeat | None) -> list[str]:
    """The features of ``needed`` the member's newest heartbeat does not declare (all of them when it
    declares none, or no heartbeat came)."""
    have = set(heartbeat.capabilities or ()) if heartbeat is not None else set()
    return [f for f in needed if f not in have]


def refusal_message(member_id: str, missing: list[str]) -> str:
    return (f"member {member_id} does not support {' and '.join(missing)} (its heartbeat does not declare "
            f"{'them' if len(missing) > 1 else 'it'}: an older engine would ignore the field and answer as if it "
            "were absent); no other member of the pool could take the request")
