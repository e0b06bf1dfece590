"""Tools in the prompt for a chat template that does not render them: the Hermes / Qwen3 convention.

A checkpoint whose template knows tools (Qwen2.5/3, Hermes, Llama 3.1 ...) gets ``tools``, assistant
``tool_calls`` and ``role: tool`` turns through its own template, as transformers passes them. A template
that ignores ``tools`` (the rendering with and without them is the same: our tiny test checkpoints, many
base models) would silently drop them; for those the messages are rewritten the way Qwen3's template
writes them, and the template renders plain text turns:

- a system turn (the first one's text, then a blank line) with ``# Tools``, the tools as JSON lines inside
  ``<tools></tools>`` and the instruction to answer with ``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>`` blocks;
- an assistant turn's ``tool_calls`` appended to its content as those blocks;
- consecutive ``tool`` turns as one ``user`` turn of ``<tool_response>…</tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    return _PREAMBLE + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + _INSTRUCTIONS


def call_block(call: Mapping[str, Any]) -> str:
    fn = call.get("function", {})
    return ("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                                         ensure_ascii=False) + "\n</tool_call>")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def fold_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
               ) -> list[dict[str, Any]]:
    """``messages`` with the tools, the calls and the tool results written into plain text turns."""
    out: list[dict[str, Any]] = []
    rest = [dict(m) for m in messages]
    if tools:
        block = tools_system_text(tools)
        if rest and rest[0].get("role") in ("system", "developer"):
            first = rest.pop(0)
            out.append({"role": "system", "content": _text(first.get("content")) + "\n\n" + block})
        else:
            out.append({"role": "system", "content": block})
    for m in rest:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            text = _text(m.get("content"))
            blocks = "\n".join(call_block(c) for c in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (text + "\n" if text else "") + blocks
            out.append(m)
        elif role == "tool":
            response = "<tool_response>\n" + _text(m.get("content")) + "\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].pop("_tool_responses", False):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            out[-1]["_tool_responses"] = True
        else:
            out.append(m)
    for m in out:
        m.pop("_tool_responses", None)
    return out


def tool_call_schema(tools: Sequence[tuple[str, str]], arguments_key: str = "arguments") -> str:
    """The JSON schema of one call to one of ``tools`` (name, parameters schema as JSON text):
    ``{"name": <one of the names>, "arguments": <that tool's parameters>}`` (Qwen3/Hermes; Llama 3 names the
    arguments ``"parameters"``: ``arguments_key``)."""
    def arguments(parameters: str) -> Any:
        schema = json.loads(parameters)
        # the arguments are an object whatever the schema left open (an empty schema allows any JSON)
        return {**schema, "type": "object"} if isinstance(schema, dict) and "type" not in schema else schema

    cases = [{"type": "object", "properties": {"name": {"const": name}, arguments_key: arguments(parameters)},
              "required": ["name", arguments_key]} for name, parameters in tools]
    return json.dumps(cases[0] if len(cases) == 1 else {"anyOf": cases})
