"""What a request needs from a bus member, and what a heartbeat that does not declare it lacks (pure)."""

from __future__ import annotations

from proto import ChatMessage, Constraint, GenerateRequest, SlotHeartbeat, Tool, ToolCall
from services.gateway.capabilities import missing_features, required_features


def _hb(capabilities: list[str] | None) -> SlotHeartbeat:
    return SlotHeartbeat(worker_id="w", session_id="s", seq=1, ts_s=0.0, model_id="m", capabilities=capabilities)


def test_tools_calls_tool_turns_and_constraints_each_need_their_feature() -> None:
    plain = GenerateRequest(request_id="r", model="m", messages=[ChatMessage(role="user", content="hi")])
    assert required_features(plain) == []
    assert required_features(GenerateRequest(request_id="r", model="m", tools=[Tool(name="f")],
                                             tool_choice="none")) == ["tools"]  # rendered even with "none"
    history = [ChatMessage(role="assistant", tool_calls=[ToolCall(id="c", name="f", arguments="{}")]),
               ChatMessage(role="tool", content="1", tool_call_id="c")]
    assert required_features(GenerateRequest(request_id="r", model="m", messages=history)) == ["tools"]
    both = GenerateRequest(request_id="r", model="m", tools=[Tool(name="f")], constraint=Constraint(kind="json_object"))
    assert required_features(both) == ["tools", "structured_outputs"]


def test_a_heartbeat_that_declares_nothing_lacks_everything_asked() -> None:
    needed = ["tools", "structured_outputs"]
    assert missing_features(needed, _hb(None)) == needed  # an engine from before the field
    assert missing_features(needed, None) == needed  # no heartbeat yet
    assert missing_features(needed, _hb(["tools"])) == ["structured_outputs"]
    assert missing_features(needed, _hb(["tools", "structured_outputs", "embeddings"])) == []
    assert missing_features([], _hb(None)) == []  # plain requests go anywhere


def test_a_thinking_budget_or_template_variables_need_reasoning() -> None:
    """An engine from before reasoning would ignore reasoning_effort (think without bound) and
    chat_template_kwargs (think though the client turned it off)."""
    effort = GenerateRequest(request_id="r", model="m", reasoning_effort="low")
    kwargs = GenerateRequest(request_id="r", model="m", chat_template_kwargs={"enable_thinking": False})
    assert required_features(effort) == required_features(kwargs) == ["reasoning"]
    assert missing_features(["reasoning"], _hb(["tools"])) == ["reasoning"]
    from services.engine.serve.worker import ENGINE_CAPABILITIES

    assert "reasoning" in ENGINE_CAPABILITIES  # our engine declares it


def test_several_choices_echo_and_suffix_need_choices() -> None:
    for extra in ({"n": 4}, {"echo": True}, {"suffix": "tail"}):
        assert required_features(GenerateRequest(request_id="r", model="m", prompt="p", **extra)) == ["choices"]
    assert missing_features(["choices"], _hb(["tools", "reasoning"])) == ["choices"]
    from services.engine.serve.worker import ENGINE_CAPABILITIES

    assert "choices" in ENGINE_CAPABILITIES
