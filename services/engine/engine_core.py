"""EngineCore: one synchronous step loop over the scheduler, the model runner and the sampler.

The core is owned by one thread (the step thread of :mod:`async_engine`, or the caller of the
offline :class:`llm.LLM`). Each :meth:`EngineCore.step` plans a batch (scheduler), runs it (runner),
samples one token per sequence that reached its last known token (sampler), then detokenizes and
checks stop strings, and returns what each request produced as :class:`RequestOutput` values.
The clock is passed in (``now`` callables), so tests can drive it.

With speculative decoding on (``EngineConfig.spec``, see :mod:`spec_decode`), a step also verifies the
draft tokens scheduled with it (:mod:`rejection_sampler`), may emit several tokens per request (cut at
EOS, ``max_tokens`` and stop strings exactly where one-token decoding would stop), and ends by proposing
the next drafts for every caught-up request. With it off, the step is the plain path unchanged.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from services.engine.model.attention import KVCache, KVCacheSpec
from services.engine.spec.draft_model import DraftModelProposer, DraftTarget
from services.engine.errors import EngineError, InvalidParameterError
from services.engine.kernels.backend import select_backend
from services.engine.model.loader import load_model
from services.engine.model.model_runner import ModelRunner
from services.engine.spec.mtp_proposer import MTPProposer, MTPRows
from services.engine.spec.rejection_sampler import verify_greedy, verify_random
from services.engine.core.request import Request, RequestStatus
from services.engine.model.sampler import History, Sampler, TokenLogprobs, sampling_probs
from services.engine.core.sampling_params import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SchedulerStats
from services.engine.spec.spec_decode import SpecConfig, SpecDecodeCounters, SpecDecodeStats, check_mtp, propose_ngram
from services.engine.core.stop_checker import StopChecker
from services.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

# Share of the free memory the KV cache may take when no capacity is given.
DEFAULT_KV_MEMORY_FRACTION = 0.25
THROUGHPUT_WINDOW_S = 5.0


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """One engine's settings. ``kv_capacity_tokens`` None sizes the cache from free memory."""

    model_path: Path
    model_id: str | None = None
    dtype: str | None = None
    device: str = "cpu"
    backend: str | None = None  # kernels: "auto"/None (triton on CUDA, else torch), "torch", "triton"
    kv_dtype: Literal["auto", "fp8"] = "auto"
    kv_capacity_tokens: int | None = None
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    block_size: int = 16
    max_concurrency: int = 8
    max_pending_requests: int = 64
    max_context: int | None = None
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    preserve_thinking: bool = False
    torch_threads: int | None = None
    # Decode steps through CUDA graphs where they can run (CUDA device, triton backend); False: eager always.
    cuda_graphs: bool = True
    # Outputs of a request that is already streaming are released at most this often (see
    # async_engine.StreamInterval); 0 releases every step's tokens at once. Offline generate ignores it.
    stream_interval_ms: float = 0.0
    spec: SpecConfig = field(default_factory=SpecConfig)


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Milliseconds, measured on the engine's monotonic clock."""

    queue_ms: float
    prompt_ms: float
    predicted_ms: float
    ttft_ms: float | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced in one step. ``text`` is the new text only (stop strings removed)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    timings: RequestTimings | None = None
    # Speculative decoding, so far for this request: draft tokens proposed, and accepted by the target.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # One entry per token in ``token_ids`` when the request asked for logprobs, else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What telemetry publishes: scheduler state, totals since start, throughput over a window."""

    stats: SchedulerStats
    lanes: int
    max_pending: int
    max_context: int
    kv_capacity_tokens: int
    admitted_total: int
    admitted_by_source: dict[str, int]
    prompt_tokens_total: int
    output_tokens_total: int
    prefill_tok_per_s: float
    decode_tok_per_s: float
    spec: SpecDecodeStats | None = None  # None when the engine does not speculate


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    generator: torch.Generator | None


@dataclass
class ThroughputWindow:
    """Tokens per second over the last ``window_s`` seconds (pure: times are passed in)."""

    window_s: float = THROUGHPUT_WINDOW_S
    _events: collections.deque[tuple[float, int, int]] = field(default_factory=collections.deque)
    _prefill: int = 0  # sums over _events, kept as they change: rates() is O(1) at every step
    _decode: int = 0

    def add(self, now: float, prefill_tokens: int, decode_tokens: int) -> None:
        self._events.append((now, prefill_tokens, decode_tokens))
        self._prefill += prefill_tokens
        self._decode += decode_tokens
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            _, prefill, decode = self._events.popleft()
            self._prefill -= prefill
            self._decode -= decode

    def rates(self, now: float) -> tuple[float, float]:
        self._trim(now)
        return self._prefill / self.window_s, self._decode / self.window_s


def free_memory_bytes(device: torch.device) -> int:
    """Free VRAM on CUDA, else available RAM (MemAvailable)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30


class PromptEncoder:
    """What the HTTP and bus layers need of an engine to turn a request into prompt tokens.

    The :class:`EngineCore` is one; so is the API side of an engine whose core runs in another process
    (:class:`services.engine.serve.async_engine.ProcessEngine`), which loads the tokenizer but not the model.
    """

    config: EngineConfig
    tokenizer: Tokenizer
    model_id: str
    max_context: int

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, preserve_thinking=self.config.preserve_thinking
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)


def _by_request(request_ids: Sequence[str], logprobs: Sequence[TokenLogprobs | None] | None
                ) -> dict[str, TokenLogprobs]:
    """The sampler's per-row logprobs keyed by the rows' request ids (the rows that asked only)."""
    if logprobs is None:
        return {}
    return {rid: lp for rid, lp in zip(request_ids, logprobs, strict=True) if lp is not None}


def _histories(requests: Sequence[Request | None]) -> list[History | None] | None:
    """What the sampler's penalties and min_tokens need, per request; None when no request has any."""
    if not any(r is not None and r.sampling_params.shapes_logits for r in requests):
        return None
    return [_history(r) if r.sampling_params.shapes_logits else None for r in requests if r is not None]


def _history(request: Request) -> History:
    params = request.sampling_params
    stop_ids: tuple[int, ...] = ()
    if request.num_output_tokens < params.min_tokens:  # the only steps that suppress them
        eos_ids = () if params.ignore_eos else request.eos_token_ids
        stop_ids = tuple(sorted({*params.stop_token_ids, *eos_ids}))
    return History(request.prompt_token_ids, request.output_token_ids, stop_ids)


class EngineCore(PromptEncoder):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        spec_config = config.spec.validate()
        if spec_config.method == "mtp":
            check_mtp(Path(config.model_path))  # no mtp.* tensors: refused before the model loads
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.device = torch.device(config.device)
        self.backend = select_backend(self.device, config.backend)
        self.model, self.model_config = load_model(config.model_path, dtype=config.dtype, device=self.device,
                                                   backend=self.backend)
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.model_id = config.model_id or Path(config.model_path).name
        dtype = next(self.model.parameters()).dtype
        spec = KVCacheSpec(
            num_layers=self.model_config.num_hidden_layers, num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim, block_size=config.block_size, dtype=dtype,
            kv_cache_dtype=config.kv_dtype,
        )
        self.free_memory_bytes = free_memory_bytes(self.device)
        if config.kv_capacity_tokens is not None:
            # +1 block: block 0 is the scheduler's reserved null block.
            self.kv_cache = KVCache.for_capacity_tokens(spec, config.kv_capacity_tokens + config.block_size,
                                                        self.device)
        else:
            # From free memory, but no more than every lane at full context twice over (the second
            # half keeps finished prefixes cached): beyond that, memory buys nothing.
            budget = int(self.free_memory_bytes * config.kv_memory_fraction)
            context = config.max_context or self.model_config.max_position_embeddings
            useful_tokens = 2 * config.max_concurrency * context + config.block_size
            budget = min(budget, useful_tokens * spec.bytes_per_token)
            self.kv_cache = KVCache.for_byte_budget(spec, budget, self.device)
        self.kv_capacity_tokens = (self.kv_cache.num_blocks - 1) * config.block_size
        model_limit = self.model_config.max_position_embeddings
        self.max_context = min(config.max_context or model_limit, model_limit)
        if self.max_context > self.kv_capacity_tokens and config.max_context is not None:
            raise EngineError(
                f"max_context {self.max_context} exceeds the KV capacity of {self.kv_capacity_tokens} tokens: "
                "raise --kv-capacity or lower --max-context"
            )
        self.max_context = min(self.max_context, self.kv_capacity_tokens)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens, max_concurrency=config.max_concurrency,
            max_pending_requests=config.max_pending_requests, max_context=self.max_context,
            block_size=config.block_size, num_blocks=self.kv_cache.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
        ))
        self.runner = ModelRunner(self.model, self.model_config, self.kv_cache, config.block_size, self.device)
        self.cuda_graphs = self._capture_decode_graphs()
        self.sampler = Sampler()
        self.eos_token_ids = self.tokenizer.stop_token_ids
        self._states: dict[str, _RequestState] = {}
        self._throughput = ThroughputWindow()
        self.admitted_total = 0
        self.admitted_by_source: collections.Counter[str] = collections.Counter()
        self.prompt_tokens_total = 0
        self.output_tokens_total = 0
        self.spec_config = spec_config
        self.spec_counters: SpecDecodeCounters | None = None
        self.drafter: DraftModelProposer | None = None
        self.mtp: MTPProposer | None = None
        # Draft distributions of pending model drafts of sampled requests, by request id.
        self._draft_probs: dict[str, torch.Tensor] = {}
        if spec_config.is_enabled:
            self.spec_counters = SpecDecodeCounters(spec_config.method, spec_config.num_draft_tokens)
        if spec_config.method == "draft":
            assert spec_config.draft_model_path is not None  # validate() checked
            self.drafter = DraftModelProposer(
                Path(spec_config.draft_model_path), target=self.model, target_config=self.model_config,
                target_tokenizer=self.tokenizer, num_draft_tokens=spec_config.num_draft_tokens,
                num_target_blocks=self.kv_cache.num_blocks, block_size=config.block_size,
                max_concurrency=config.max_concurrency, max_context=self.max_context, kv_dtype=config.kv_dtype,
                lm_head_draft=spec_config.lm_head_draft, device=self.device,
            )
        if spec_config.method == "mtp":
            self.mtp = MTPProposer(
                Path(config.model_path), target=self.model, target_config=self.model_config,
                num_draft_tokens=spec_config.num_draft_tokens, num_target_blocks=self.kv_cache.num_blocks,
                block_size=config.block_size, max_concurrency=config.max_concurrency, kv_dtype=config.kv_dtype,
                device=self.device,
            )

    def _capture_decode_graphs(self) -> str:
        """Capture the decode graphs where they apply; what happened, for the startup line."""
        if not self.config.cuda_graphs:
            return "off (--no-cuda-graphs)"
        if self.device.type != "cuda" or self.backend != "triton":
            return f"off ({self.device.type}, {self.backend} backend)"
        started = time.monotonic()
        try:
            self.runner.enable_decode_graphs(self.config.max_concurrency, self.max_context)
        except Exception as exc:  # eager decoding still works: say why and go on
            self.runner.graphs = None
            log.warning("CUDA graphs off: capture failed: %s", exc)
            return f"off (capture failed: {type(exc).__name__})"
        assert self.runner.graphs is not None
        sizes = self.runner.graphs.sizes
        return f"on (decode batch sizes {', '.join(map(str, sizes))}; captured in {time.monotonic() - started:.1f} s)"

    # ---- intake -------------------------------------------------------------------------------------

    def unfinished_request_ids(self) -> list[str]:
        return list(self._states)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    now: float, source: str = "") -> None:
        """Queue a request. Raises InvalidParameterError, ContextLengthExceededError, QueueFullError."""
        self.admitted_by_source[source] += 1  # counts every request received, refused or not
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "", "the prompt encodes to no tokens")
        params.validate()
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidParameterError("prompt", "token ids", f"token ids must be in [0, {vocab})")
        request = Request(request_id, prompt_token_ids, params, arrival_s=now, eos_token_ids=self.eos_token_ids)
        self.scheduler.add_request(request)
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._states[request_id] = _RequestState(
            IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_token_ids), StopChecker(params.stop), generator
        )
        self.admitted_total += 1
        self.prompt_tokens_total += len(prompt_token_ids)

    def abort(self, request_id: str, now: float) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id, now)
        state = self._states.pop(request_id, None)
        if request is None or state is None:
            return None
        return self._output(request, "", (), now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------------

    def step(self, now: Callable[[], float]) -> list[RequestOutput]:
        plan = self.scheduler.schedule(now())
        if plan.is_empty:
            return []
        if self.mtp is not None:
            logits, hidden = self.runner.run_with_hidden(plan.scheduled)
        else:
            logits, hidden = self.runner.run(plan.scheduled), None
        if self.spec_counters is not None:
            outputs = self._speculative_step(plan, logits, now)
            self._propose_drafts(plan, hidden)
            return outputs
        sampled_seqs = [s for s in plan.scheduled if s.needs_logits]
        requests = [self.scheduler.get_request(s.request_id) for s in sampled_seqs]
        params = [r.sampling_params for r in requests if r is not None]
        generators = [self._states[r.request_id].generator for r in requests if r is not None]
        token_ids, logprobs = self.sampler.sample(logits, params, generators, _histories(requests))
        sampled = {s.request_id: t for s, t in zip(sampled_seqs, token_ids, strict=True)}
        token_logprobs = _by_request([s.request_id for s in sampled_seqs], logprobs)
        t = now()
        updated = self.scheduler.update_from_output(plan, sampled, t)
        self._throughput.add(t, plan.num_prefill_tokens, plan.num_decode_tokens)
        outputs = []
        for request in updated:
            rid = request.request_id
            if rid not in sampled:
                continue  # a prefill chunk that is not the last: nothing to say yet
            outputs.append(self._emit(request, sampled[rid], t, token_logprobs.get(rid)))
        return outputs

    def _emit(self, request: Request, token_id: int, now: float,
              logprob: TokenLogprobs | None = None) -> RequestOutput:
        state = self._states[request.request_id]
        self.output_tokens_total += 1
        finished_by_token = request.is_finished and request.finish_reason == "stop"
        delta = "" if finished_by_token else state.detokenizer.push(token_id)
        if request.num_output_tokens <= request.sampling_params.min_tokens:
            text, is_stopped = delta, False  # min_tokens: stop strings count only in the text after it
        else:
            scan = state.stop_checker.feed(delta)
            text, is_stopped = scan.text_to_emit, scan.is_stopped
        if is_stopped and not request.is_finished:
            self.scheduler.finish_request(request.request_id, "stop", now)
        if request.is_finished:
            if not is_stopped:
                text += state.stop_checker.feed(state.detokenizer.flush()).text_to_emit
                text += state.stop_checker.flush()
            del self._states[request.request_id]
        return self._output(request, text, (token_id,), now, None if logprob is None else (logprob,))

    # ---- speculative decoding ------------------------------------------------------------------------

    def _speculative_step(self, plan: SchedulerOutput, logits: torch.Tensor,
                          now: Callable[[], float]) -> list[RequestOutput]:
        """The step's sampling and bookkeeping when drafts may be in it (logits: 1 + k rows per seq)."""
        plain_rows: list[int] = []
        plain_ids: list[str] = []
        spec_seqs = []
        row = 0
        for seq in plan.scheduled:
            if not seq.needs_logits:
                continue
            if seq.num_draft_tokens:
                spec_seqs.append((seq, row))
                row += 1 + seq.num_draft_tokens
            else:
                plain_rows.append(row)
                plain_ids.append(seq.request_id)
                row += 1
        sampled: dict[str, int] = {}
        if plain_ids:
            requests = [self.scheduler.get_request(rid) for rid in plain_ids]
            params = [r.sampling_params for r in requests if r is not None]
            generators = [self._states[r.request_id].generator for r in requests if r is not None]
            plain_logits = logits if len(plain_rows) == row else logits[plain_rows]
            token_ids, logprobs = self.sampler.sample(plain_logits, params, generators, _histories(requests))
            sampled = dict(zip(plain_ids, token_ids, strict=True))
            token_logprobs = _by_request(plain_ids, logprobs)
        else:
            token_logprobs = {}
        accepted: dict[str, list[int]] = {}
        run_logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
        scans: dict[str, tuple[str, bool]] = {}
        for seq, first_row in spec_seqs:
            request = self.scheduler.get_request(seq.request_id)
            assert request is not None
            tokens = self._verify(request, seq.token_ids[-seq.num_draft_tokens:],
                                  logits[first_row : first_row + 1 + seq.num_draft_tokens])
            num_kept, reason = Scheduler.num_tokens_until_stop(request, tokens)
            tokens = tokens[:num_kept]
            num_kept, text, is_stopped = self._scan_run(request, tokens, skip_last=reason == "stop")
            accepted[seq.request_id] = tokens[:num_kept]
            scans[seq.request_id] = (text, is_stopped)
            if (top_n := request.sampling_params.logprobs) is not None:
                # Each kept token's row of the verification logits is the target's distribution there.
                rows = logits[first_row : first_row + num_kept]
                run_logprobs[seq.request_id] = tuple(self.sampler.token_logprobs(rows, tokens[:num_kept], top_n))
        t = now()
        updated = self.scheduler.update_from_output(plan, sampled, t, accepted)
        num_extra = sum(len(run) - 1 for run in accepted.values())
        self._throughput.add(t, plan.num_prefill_tokens, plan.num_decode_tokens + num_extra)
        outputs = []
        for request in updated:
            rid = request.request_id
            if rid in accepted:
                text, is_stopped = scans[rid]
                outputs.append(self._emit_run(request, accepted[rid], text, is_stopped, t, run_logprobs.get(rid)))
            elif rid in sampled:
                outputs.append(self._emit(request, sampled[rid], t, token_logprobs.get(rid)))
        return outputs

    def _verify(self, request: Request, drafts: Sequence[int], logits: torch.Tensor) -> list[int]:
        """Accepted drafts + the target's next token for one request; updates the counters."""
        params = request.sampling_params
        draft_probs = self._draft_probs.pop(request.request_id, None)
        if params.is_greedy:
            tokens = verify_greedy(logits, drafts)
        else:
            q = None if draft_probs is None else draft_probs[: len(drafts)]
            tokens = verify_random(sampling_probs(logits, params), drafts, q,
                                   self._states[request.request_id].generator)
        assert self.spec_counters is not None
        self.spec_counters.record(len(drafts), len(tokens) - 1)
        request.num_draft_tokens += len(drafts)
        request.num_accepted_draft_tokens += len(tokens) - 1
        return tokens

    def _scan_run(self, request: Request, tokens: Sequence[int], skip_last: bool) -> tuple[int, str, bool]:
        """Detokenize an accepted run and scan it for stop strings, token by token, as one-token steps
        would: ``(tokens to keep, text to emit, stopped by a stop string)``. ``skip_last``: the last
        token is a stop token id (EOS …), which is not detokenized (as in :meth:`_emit`)."""
        state = self._states[request.request_id]
        text = ""
        for i, token_id in enumerate(tokens):
            is_last = i == len(tokens) - 1
            delta = "" if is_last and skip_last else state.detokenizer.push(token_id)
            scan = state.stop_checker.feed(delta)
            text += scan.text_to_emit
            if scan.is_stopped:
                return i + 1, text, True
        return len(tokens), text, False

    def _emit_run(self, request: Request, tokens: Sequence[int], text: str, is_stopped: bool,
                  now: float, logprobs: tuple[TokenLogprobs, ...] | None = None) -> RequestOutput:
        """:meth:`_emit` for a run already detokenized and scanned by :meth:`_scan_run`."""
        state = self._states[request.request_id]
        self.output_tokens_total += len(tokens)
        if is_stopped and not request.is_finished:
            self.scheduler.finish_request(request.request_id, "stop", now)
        if request.is_finished:
            if not is_stopped:
                text += state.stop_checker.feed(state.detokenizer.flush()).text_to_emit
                text += state.stop_checker.flush()
            del self._states[request.request_id]
        return self._output(request, text, tuple(tokens), now, logprobs)

    def _propose_drafts(self, plan: SchedulerOutput, hidden: torch.Tensor | None) -> None:
        """Give every caught-up running request (one token short of its KV) drafts for the next step.
        ``hidden``: the step's target hidden states (``--spec mtp`` only), which the MTP reads."""
        spec = self.spec_config
        running = self.scheduler.running
        live = {r.request_id for r in running}
        for rid in [r for r in self._draft_probs if r not in live]:
            del self._draft_probs[rid]
        if self.drafter is not None:
            self.drafter.release_except(live)
        wanted: list[tuple[Request, int]] = []
        for request in running:
            if request.spec_token_ids or request.num_output_tokens == 0:
                continue  # drafts still pending (not scheduled last step), or still prefilling
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            if request.sampling_params.shapes_logits:
                continue  # verification compares against the plain target rows: such requests do not speculate
            # The step verifying k drafts may append k + 1 tokens: never plan past max_tokens.
            k = min(spec.num_draft_tokens, request.sampling_params.max_tokens - request.num_output_tokens - 1)
            if k > 0:
                wanted.append((request, k))
        if self.mtp is not None:
            assert hidden is not None
            # Runs even when no request wants drafts: the MTP's K/V must cover every computed position.
            targets = {request.request_id: DraftTarget(request.request_id, request.all_token_ids, k,
                                                       request.sampling_params,
                                                       self._states[request.request_id].generator)
                       for request, k in wanted}
            proposals = self.mtp.propose(self._mtp_rows(plan, hidden), targets)
        elif not wanted:
            return
        elif self.drafter is None:
            for request, k in wanted:
                request.spec_token_ids = propose_ngram(request.all_token_ids, k, spec.ngram_max, spec.ngram_min)
            return
        else:
            proposals = self.drafter.propose([
                DraftTarget(request.request_id, request.all_token_ids, k, request.sampling_params,
                            self._states[request.request_id].generator)
                for request, k in wanted
            ])
        for request, _k in wanted:
            proposal = proposals.get(request.request_id)
            self._draft_probs.pop(request.request_id, None)
            if proposal is None:
                continue
            request.spec_token_ids = proposal.token_ids
            if proposal.probs is not None:
                self._draft_probs[request.request_id] = proposal.probs

    def _mtp_rows(self, plan: SchedulerOutput, hidden: torch.Tensor) -> list[MTPRows]:
        """Each still-running request's kept positions of this step (``start_pos`` up to its
        ``num_computed_tokens`` now: a rejected draft's position is not kept) with the token after each
        and the target's hidden state there; ``hidden``'s rows follow ``plan.scheduled``'s tokens."""
        rows: list[MTPRows] = []
        offset = 0
        for seq in plan.scheduled:
            request = self.scheduler.get_request(seq.request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                num_kept = request.num_computed_tokens - seq.start_pos
                if num_kept > 0:
                    first = seq.start_pos + 1
                    rows.append(MTPRows(seq.request_id, seq.start_pos,
                                        request.all_token_ids[first : first + num_kept],
                                        hidden[offset : offset + num_kept], tuple(request.block_ids)))
            offset += len(seq.token_ids)
        return rows

    def _output(self, request: Request, text: str, token_ids: tuple[int, ...], now: float,
                logprobs: tuple[TokenLogprobs, ...] | None = None) -> RequestOutput:
        timings = None
        if request.is_finished:
            start = request.first_scheduled_s if request.first_scheduled_s is not None else now
            first = request.first_token_s if request.first_token_s is not None else now
            timings = RequestTimings(
                queue_ms=(start - request.arrival_s) * 1000.0,
                prompt_ms=(first - start) * 1000.0,
                predicted_ms=(now - first) * 1000.0,
                ttft_ms=(request.first_token_s - request.arrival_s) * 1000.0
                if request.first_token_s is not None else None,
            )
        return RequestOutput(
            request_id=request.request_id, text=text, token_ids=token_ids,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_prompt_tokens or 0,
            num_output_tokens=request.num_output_tokens, timings=timings,
            num_draft_tokens=request.num_draft_tokens, num_accepted_draft_tokens=request.num_accepted_draft_tokens,
            logprobs=logprobs,
        )

    # ---- telemetry ---------------------------------------------------------------------------------

    def snapshot(self, now: float) -> EngineSnapshot:
        prefill, decode = self._throughput.rates(now)
        return EngineSnapshot(
            stats=self.scheduler.stats(), lanes=self.config.max_concurrency,
            max_pending=self.config.max_pending_requests, max_context=self.max_context,
            kv_capacity_tokens=self.kv_capacity_tokens, admitted_total=self.admitted_total,
            admitted_by_source=dict(self.admitted_by_source), prompt_tokens_total=self.prompt_tokens_total,
            output_tokens_total=self.output_tokens_total, prefill_tok_per_s=prefill, decode_tok_per_s=decode,
            spec=self.spec_counters.snapshot() if self.spec_counters is not None else None,
        )

    def describe(self) -> str:
        gib = self.free_memory_bytes / 2**30
        where = "VRAM" if self.device.type == "cuda" else "RAM"
        return (
            f"model {self.model_id} ({self.model_config.architecture}, "
            f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M params) on {self.device}; "
            f"free {where} {gib:.1f} GiB; KV capacity {self.kv_capacity_tokens} tokens "
            f"({self.config.kv_dtype}, {math.ceil(self.kv_cache.nbytes / 2**20)} MiB); "
            f"lanes {self.config.max_concurrency}; queue {self.config.max_pending_requests}; "
            f"max context {self.max_context}; CUDA graphs {self.cuda_graphs}; "
            f"stream interval {self.config.stream_interval_ms:g} ms"
            f"{self._describe_spec()}"
        )

    def _describe_spec(self) -> str:
        spec = self.spec_config
        if not spec.is_enabled:
            return ""
        what = f"; speculative decoding {spec.method}, {spec.num_draft_tokens} draft tokens"
        if self.drafter is not None:
            what += (f" from {spec.draft_model_path} ({self.drafter.num_params / 1e6:.1f}M params"
                     f"{', target LM head' if spec.lm_head_draft else ''})")
        if self.mtp is not None:
            what += (f" from the checkpoint's MTP module ({self.mtp.num_params / 1e6:.2f}M params, "
                     f"main LM head, {math.ceil(self.mtp.kv_cache.nbytes / 2**20)} MiB KV)")
        return what
