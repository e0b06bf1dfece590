"""A null upstream that costs next to nothing: nginx answering fixed OpenAI bodies (bench/gateway_overhead.py).

The Python null engine (aiohttp) costs the host about as much CPU per request as a gateway worker's
upstream side, so on 2 cores it takes the CPU a second gateway worker would use. nginx's ``return 200 '…'``
answers from memory in one worker process.

The bodies are the shapes vLLM returns (its OpenAI server, ``stream_options.include_usage``): a
``chat.completion`` with ``usage`` (``prompt_tokens_details`` null), and for streaming a role chunk with empty
content, ``STREAM_CHUNKS`` content chunks (the last with ``finish_reason`` and ``stop_reason``), a usage
chunk with no choices, and ``[DONE]``. One difference: nginx sends the stream in one write with a
Content-Length where vLLM sends chunked events as tokens come. nginx cannot read a request body in
``return``, so the stream is served on its own path, ``/sse/v1/chat/completions``: the gateway's pools file
gives it its own pool (``PoolsEntry``), and direct cells post there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def bodies(model: str, num_chunks: int, created: int = 1_765_000_000) -> tuple[str, str]:
    """(the non-streaming JSON, the whole SSE stream) of a null answer of ``num_chunks`` tokens."""
    usage = {"prompt_tokens": 8, "total_tokens": 8 + num_chunks, "completion_tokens": num_chunks,
             "prompt_tokens_details": None}
    full = {"id": "chatcmpl-null", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * num_chunks, "refusal": None,
                                                 "annotations": None, "audio": None, "function_call": None,
                                                 "tool_calls": [], "reasoning_content": None},
                         "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
            "service_tier": None, "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
            "kv_transfer_params": None}

    def chunk(delta: dict, finish: str | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = None
        return {"id": "chatcmpl-null", "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}

    events = [chunk({"role": "assistant", "content": ""}, None)]
    events += [chunk({"content": "x"}, "stop" if i == num_chunks - 1 else None) for i in range(num_chunks)]
    events.append({"id": "chatcmpl-null", "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage})
    sse = "".join(f"data: {json.dumps(e, separators=(',', ':'))}\n\n" for e in events) + "data: [DONE]\n\n"
    return json.dumps(full, separators=(",", ":")), sse


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def config(directory: Path, port: int, model: str, num_chunks: int) -> str:
    """nginx.conf for one worker process on 127.0.0.1:``port``, everything it writes under ``directory``."""
    full, sse = bodies(model, num_chunks)
    models = json.dumps({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]})
    d = directory
    return f"""worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/nginx.error.log warn;
events {{ worker_connections 16384; }}
http {{
  access_log off;
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location = /v1/models {{ default_type application/json; return 200 {_quoted(models)}; }}
    location = /v1/chat/completions {{ default_type application/json; return 200 {_quoted(full)}; }}
    location = /sse/v1/chat/completions {{
      default_type text/event-stream;
      add_header Cache-Control no-cache;
      return 200 {_quoted(sse)};
    }}
  }}
}}
"""


def nginx_path() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if Path(p).exists()), None)


INSTALL_HINT = "nginx not found: `apt-get install -y nginx` (Debian/Ubuntu) to measure the nginx upstream cells"
