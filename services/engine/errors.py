"""The engine's exception tree, in one place.

Every exception the engine raises on purpose derives from :class:`EngineError` and carries its facts as
attributes, so the service shell can turn it into an OpenAI error body (or a bus reply) without parsing
messages::

    EngineError                       base; ``message`` is the one-line, user-presentable text
    ├── ModelLoadError                a checkpoint directory cannot be used (``path``, ``reason``)
    │   └── UnsupportedArchitectureError   config.json names a model family we do not implement
    ├── SpeculativeDecodingError      the speculative-decoding settings cannot be served (``reason``)
    ├── DeadlineExceededError         the request's ``deadline_s`` passed before it produced anything
    ├── CoreLostError                 the engine core's process exited: nothing can be served any more
    └── ChatTemplateError (ValueError) the chat template failed to render for these messages

Errors that are programming mistakes inside the engine (a block table shorter than its sequence, say)
stay plain ``ValueError``/``AssertionError``: they are bugs, not conditions a caller can handle.

New kinds are appended at the end of this file; existing classes keep their fields.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every deliberate engine error; ``message`` is safe to show to an API user."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        # Subclasses take their facts, not the message, so the default (cls(*args)) cannot rebuild them:
        # restore the fields directly. An engine core in another process sends its errors this way.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[EngineError], args: tuple[object, ...], fields: dict[str, object]) -> EngineError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(fields)
    return err


class ModelLoadError(EngineError):
    """A model directory could not be loaded: ``path`` is what was opened, ``reason`` says why (one line)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot load model from {path}: {reason}")
        self.path = path
        self.reason = reason


# Kept next to the error so the message and the loader cannot drift apart.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class UnsupportedArchitectureError(ModelLoadError):
    """config.json's ``architectures[0]`` is not one we implement; the message lists the ones we do."""

    def __init__(self, architecture: str, path: str = "config.json") -> None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        super().__init__(path, f"unsupported architecture {architecture!r} (supported: {supported})")
        self.architecture = architecture


class ChatTemplateError(EngineError, ValueError):
    """The chat template is missing or raised while rendering; ``message`` carries the template's words."""


# --- Admission and request-validation errors (raised by scheduler.py and sampling_params.py) ----------
#
#     EngineError
#     ├── InvalidParameterError (ValueError)  a request field is out of range (``field``, ``value``)
#     ├── ContextLengthExceededError          prompt + max_tokens exceeds the per-request context limit
#     ├── QueueFullError                      the bounded pending queue is full; retry after ``retry_after_s``
#     ├── DuplicateRequestError               a request id is already waiting or running
#     └── UnsupportedParameterError           the model cannot do what a parameter asks (``field``): suffix
#                                             without fill-in-the-middle tokens, echo with logprobs


class InvalidParameterError(EngineError, ValueError):
    """A request parameter is out of range: ``field`` names it (OpenAI ``param``), ``value`` came in."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"invalid {field}={value!r}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


class ContextLengthExceededError(EngineError):
    """``prompt_tokens + max_tokens > max_context`` (OpenAI code ``context_length_exceeded``).

    ``max_context`` is the limit that was applied: the configured per-request limit, or the whole KV
    cache's capacity in tokens when that is smaller.
    """

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int) -> None:
        super().__init__(
            f"this model's maximum context length is {max_context} tokens; the request asks for "
            f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt + {max_tokens} to generate)"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_context = max_context


class QueueFullError(EngineError):
    """The pending queue already holds ``max_pending_requests``; the shell answers 429 with Retry-After."""

    def __init__(self, num_pending: int, max_pending_requests: int, retry_after_s: float) -> None:
        super().__init__(
            f"engine queue is full ({num_pending}/{max_pending_requests} pending); "
            f"retry after {retry_after_s:g} s"
        )
        self.num_pending = num_pending
        self.max_pending_requests = max_pending_requests
        self.retry_after_s = retry_after_s


class DuplicateRequestError(EngineError):
    """A request with this ``request_id`` is already waiting or running in this scheduler."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use")
        self.request_id = request_id


class SpeculativeDecodingError(EngineError):
    """The speculative-decoding configuration cannot be served (bad K, a draft model that does not fit
    the target, ``--spec mtp`` on a checkpoint without MTP weights …). Raised at start, never per request."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"speculative decoding: {reason}")
        self.reason = reason


class DeadlineExceededError(EngineError):
    """The request's ``deadline_s`` (absolute UTC, ``time.time()``) passed before it produced anything: the
    gateway has given up on it, so the bus worker drops it (before admission, or still queued) with a 504."""

    def __init__(self, deadline_s: float, now_s: float, where: str) -> None:
        super().__init__(f"deadline exceeded {now_s - deadline_s:.3f} s ago, {where}")
        self.deadline_s = deadline_s
        self.now_s = now_s
        self.where = where


class UnsupportedParameterError(EngineError):
    """The request asks for something this engine or model cannot do (OpenAI code ``unsupported_parameter``):
    ``field`` names the parameter, ``message`` says why (``suffix`` without fill-in-the-middle tokens, say)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CoreLostError(EngineError):
    """The engine core's process exited (a crash, the OOM killer): requests get 503 at once, and the
    service stops so its supervisor (systemd, compose, ``llmgw up``) starts it again. ``exit_code`` is the
    process's exit code (negative: the signal that killed it), None when not known yet."""

    def __init__(self, pid: int | None, exit_code: int | None) -> None:
        if exit_code is None:
            how = "exit code unknown"
        else:
            how = f"killed by signal {-exit_code}" if exit_code < 0 else f"exit code {exit_code}"
        super().__init__(f"the engine core process {pid} exited ({how})")
        self.pid = pid
        self.exit_code = exit_code
