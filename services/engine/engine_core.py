"""EngineCore: one synchronous step loop over the scheduler, the model runner and the sampler.

The core is owned by one thread (the step thread of :mod:`async_engine`, or the caller of the offline
:class:`llm.LLM`). Each :meth:`EngineCore.step` plans a batch (scheduler), runs it (runner), samples one token
per sequence that reached its last known token (sampler), then detokenizes and checks stop strings, and
returns what each request produced as :class:`RequestOutput` values. The clock is passed in (``now``
callables), so tests can drive it.

Construction only wires parts built elsewhere: the KV cache is sized by ``model/kv_cache.py``, the CUDA graphs
are captured by ``model_runner.capture_decode_graphs``, the speculator is built by ``spec/speculator.py``.
With speculative decoding on (``EngineConfig.spec``), a step also verifies the draft tokens scheduled with it
(:class:`~services.engine.spec.speculator.Speculator`), may emit several tokens per request (cut at EOS,
``max_tokens`` and stop strings exactly where one-token decoding would stop), and ends by proposing the next
drafts for every caught-up request. With it off, the step is the plain path unchanged.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xgrammar as xgr

from services.common.prom import INTER_TOKEN_BUCKETS_S, ITERATION_TOKENS_BUCKETS, Histogram
from services.engine.config import EngineConfig
from services.engine.core.request import Request
from services.engine.core.sampling_params import SamplingParams, ThinkingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.core.stop_checker import StopChecker
from services.engine.errors import ContextLengthExceededError, InvalidParameterError, QueueFullError
from services.engine.kernels.backend import select_backend
from services.engine.model.grammar import GrammarCache, apply_grammar_masks
from services.engine.model.kv_cache import KVCacheSpec, allocate_kv_cache, free_memory_bytes
from services.engine.model.loader import load_model, resolve_quant_dequant
from services.engine.model.model_runner import ModelRunner, RunnerSeq, capture_decode_graphs
from services.engine.model.pooler import pool
from services.engine.model.sampler import Sampler, TokenLogprobs, histories, logprobs_by_request
from services.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from services.engine.outputs import EngineSnapshot, RequestOutput, RequestTimings
from services.engine.spec.draft_model import DraftModelProposer
from services.engine.spec.mtp_proposer import MTPProposer
from services.engine.spec.spec_decode import SpecDecodeCounters, check_mtp
from services.engine.spec.speculator import Speculator

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 5.0


# Decode tok/s of an fp8 KV cache over the default on the CPU, concurrency 1 (bench/kv_dtype.py; the figure and
# the machine are in docs/benchmarks.md): quoted by the start line when fp8 KV runs on the CPU.
CPU_FP8_DECODE_SLOWDOWN = 20

@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    generator: torch.Generator | None
    # structured output: the request's grammar position (it has accepted every token emitted so far)
    matcher: xgr.GrammarMatcher | None = None
    # a thinking model's reply (SamplingParams.thinking): inside the <think> block, tokens spent there, and
    # the tokens still to force once its budget ran out
    is_thinking: bool = False
    num_reasoning_tokens: int = 0
    forced: list[int] = field(default_factory=list)
    thinking_done: bool = False

    def force_thinking_end(self, thinking: ThinkingParams | None) -> int | None:
        """The token this step must take instead of the sampled one (a spent thinking budget), or None."""
        if thinking is None:
            return None
        if self.forced:
            return self.forced.pop(0)
        if (self.is_thinking and thinking.budget_tokens is not None
                and self.num_reasoning_tokens >= thinking.budget_tokens):
            self.forced = list(thinking.end_ids or (thinking.end_id,))
            return self.forced.pop(0)
        return None

    def holds_grammar(self, thinking: ThinkingParams | None) -> bool:
        """The request's grammar is not applied yet: its reply started inside <think>, still open (or the
        tokens that close it are still being forced)."""
        return thinking is not None and thinking.starts_inside and (not self.thinking_done or bool(self.forced))

    def follow_thinking(self, thinking: ThinkingParams | None, tokens: Sequence[int]) -> None:
        """Count the emitted ``tokens`` that belong to the <think> block (its tags included)."""
        if thinking is None:
            return
        for token_id in tokens:
            if self.thinking_done:
                return
            if not self.is_thinking and token_id == thinking.start_id:
                self.is_thinking = True
            if self.is_thinking:
                self.num_reasoning_tokens += 1
                if token_id == thinking.end_id:
                    self.is_thinking, self.thinking_done = False, True


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


class EngineCore:
    """The step loop's owner; construction wires the parts (each built by its own module)."""

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
                                                   backend=self.backend, quant_dequant=config.quant_dequant)
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.model_id = config.model_id or Path(config.model_path).name
        spec = KVCacheSpec(
            num_layers=self.model_config.num_hidden_layers, num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim, block_size=config.block_size,
            dtype=next(self.model.parameters()).dtype, kv_cache_dtype=config.kv_dtype,
        )
        self.free_memory_bytes = free_memory_bytes(self.device)
        sized = allocate_kv_cache(
            spec, self.device, free_bytes=self.free_memory_bytes, capacity_tokens=config.kv_capacity_tokens,
            memory_fraction=config.kv_memory_fraction, max_concurrency=config.max_concurrency,
            max_context=config.max_context, model_max_context=self.model_config.max_position_embeddings,
        )
        self.kv_cache, self.kv_capacity_tokens, self.max_context = (
            sized.kv_cache, sized.kv_capacity_tokens, sized.max_context)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens, max_concurrency=config.max_concurrency,
            max_pending_requests=config.max_pending_requests, max_context=self.max_context,
            block_size=config.block_size, num_blocks=self.kv_cache.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
        ))
        self.runner = ModelRunner(self.model, self.model_config, self.kv_cache, config.block_size, self.device)
        self.cuda_graphs = capture_decode_graphs(
            self.runner, enabled=config.cuda_graphs, device=self.device, backend=self.backend,
            max_batch_size=config.max_concurrency, max_context=self.max_context,
        )
        self.sampler = Sampler()
        self.eos_token_ids = self.tokenizer.stop_token_ids
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._states: dict[str, _RequestState] = {}
        self._throughput = ThroughputWindow()
        # vLLM's per-iteration histograms (vllm/v1/metrics/loggers.py): tokens per step, and per request the
        # gap between consecutive emissions (one per step that gave it tokens, several with speculation)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.inter_token_latency = Histogram(INTER_TOKEN_BUCKETS_S)
        self.admitted_total = 0
        self.admitted_by_source: collections.Counter[str] = collections.Counter()
        self.prompt_tokens_total = 0
        self.output_tokens_total = 0
        self.spec_config = spec_config
        self.speculator = Speculator.build(
            spec_config, model_path=Path(config.model_path), target=self.model, target_config=self.model_config,
            target_tokenizer=self.tokenizer, kv_cache=self.kv_cache, block_size=config.block_size,
            max_concurrency=config.max_concurrency, max_context=self.max_context, kv_dtype=config.kv_dtype,
            device=self.device,
        )

    @property
    def spec_counters(self) -> SpecDecodeCounters | None:
        return self.speculator.counters if self.speculator is not None else None

    @property
    def drafter(self) -> DraftModelProposer | None:
        return self.speculator.drafter if self.speculator is not None else None

    @property
    def mtp(self) -> MTPProposer | None:
        return self.speculator.mtp if self.speculator is not None else None

    # ---- intake -------------------------------------------------------------------------------------

    def unfinished_request_ids(self) -> list[str]:
        return list(self._states)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    now: float, source: str = "") -> None:
        """Queue a request. Raises InvalidParameterError, ContextLengthExceededError, QueueFullError."""
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "", "the prompt encodes to no tokens")
        params.validate()
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidParameterError("prompt", "token ids", f"token ids must be in [0, {vocab})")
        # compiled (or found in the cache) before the request is queued: a bad schema is a 400, not a failed step
        matcher = None if params.structured is None else self.grammars.matcher(params.structured)
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidParameterError("logit_bias", "token ids", f"token ids must be in [0, {vocab})")
        request = Request(request_id, prompt_token_ids, params, arrival_s=now, eos_token_ids=self.eos_token_ids)
        self.scheduler.add_request(request)
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._states[request_id] = _RequestState(
            IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_token_ids), StopChecker(params.stop), generator,
            matcher, is_thinking=params.thinking is not None and params.thinking.starts_inside,
        )
        self.admitted_total += 1
        # Admitted only: a refusal (bad parameters, context, 429 queue full) is never counted, as the gateway
        # un-books what a member refused (docs/routing.md §2, issue #29: counting refusals here while the
        # gateway un-counted them drove routed - admitted negative after any 429)
        self.admitted_by_source[source] += 1
        self.prompt_tokens_total += len(prompt_token_ids)

    def embed(self, request_id: str, inputs: Sequence[Sequence[int]], now: float) -> list[torch.Tensor]:
        """One L2-normalised float32 vector ``[hidden_size]`` per input, pooled (``config.pooling``) over the
        final-normed hidden states of a forward pass over the whole input, between two steps.

        Inputs run together, up to ``max_num_batched_tokens`` per forward (as one prefill step's sequences);
        each borrows KV blocks from the scheduler's pool for that forward (the model writes K/V as it goes)
        and gives them back at once; nothing is cached, nothing is sampled. Raises
        InvalidParameterError (empty input, a token id outside the vocabulary), ContextLengthExceededError
        (an input longer than ``max_context``), QueueFullError (no free blocks for it right now).
        """
        vocab = self.model_config.vocab_size
        for ids in inputs:
            if not ids:
                raise InvalidParameterError("input", "", "an input encodes to no tokens")
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidParameterError("input", "token ids", f"token ids must be in [0, {vocab})")
            if len(ids) > self.max_context:
                raise ContextLengthExceededError(len(ids), 0, self.max_context)
        vectors: list[torch.Tensor] = []
        start = 0
        while start < len(inputs):
            # one forward per batch of inputs of up to max_num_batched_tokens (one longer input runs alone)
            end, num_tokens = start + 1, len(inputs[start])
            while end < len(inputs) and num_tokens + len(inputs[end]) <= self.config.max_num_batched_tokens:
                num_tokens += len(inputs[end])
                end += 1
            vectors += self._embed_batch(request_id, inputs, start, end, now)
            start = end
        self.prompt_tokens_total += sum(len(ids) for ids in inputs)
        return vectors

    def _embed_batch(self, request_id: str, inputs: Sequence[Sequence[int]], start: int, end: int,
                     now: float) -> list[torch.Tensor]:
        """:meth:`embed` of ``inputs[start:end]`` in one forward (each a sequence of its own in the step)."""
        pool_blocks = self.scheduler.block_pool
        borrowers: list[Request] = []
        try:
            for i in range(start, end):
                borrower = Request(f"{request_id}/embed/{i}", inputs[i], SamplingParams(max_tokens=1), arrival_s=now)
                if not pool_blocks.allocate_slots(borrower, len(inputs[i])):
                    raise QueueFullError(self.scheduler.stats().num_waiting, self.config.max_pending_requests, 1.0)
                borrowers.append(borrower)
            seqs = [RunnerSeq(token_ids=inputs[start + k], start_pos=0, block_table=b.block_ids, needs_logits=False)
                    for k, b in enumerate(borrowers)]
            _, hidden = self.runner.run_with_hidden(seqs)
        finally:
            for borrower in borrowers:
                pool_blocks.free(borrower)
        out, row = [], 0
        for i in range(start, end):
            out.append(pool(hidden[row : row + len(inputs[i])], self.config.pooling).cpu())
            row += len(inputs[i])
        return out

    def abort(self, request_id: str, now: float) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id, now)
        state = self._states.pop(request_id, None)
        if request is None or state is None:
            return None
        return self._output(request, "", (), now, num_reasoning_tokens=state.num_reasoning_tokens)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------------

    def step(self, now: Callable[[], float]) -> list[RequestOutput]:
        plan = self.scheduler.schedule(now())
        if plan.is_empty:
            return []
        if self.speculator is not None and self.speculator.needs_hidden:
            logits, hidden = self.runner.run_with_hidden(plan.scheduled)
        else:
            logits, hidden = self.runner.run(plan.scheduled), None
        if self.speculator is None:
            return self._plain_step(plan, logits, now)
        outputs = self._speculative_step(plan, logits, now, self.speculator)
        self.speculator.propose(plan, hidden, self.scheduler.running, self.scheduler.get_request,
                                self._generator)
        return outputs

    def _generator(self, request_id: str) -> torch.Generator | None:
        return self._states[request_id].generator

    def _sample(self, logits: torch.Tensor, request_ids: Sequence[str]
                ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """One token per row of ``logits`` (one row per request id): the tokens and the rows' logprobs."""
        requests = [self.scheduler.get_request(rid) for rid in request_ids]
        params = [r.sampling_params for r in requests if r is not None]
        states = [self._states[r.request_id] for r in requests if r is not None]
        generators = [s.generator for s in states]
        # a reply that starts inside <think> is constrained from its answer on (the grammar waits for </think>
        # and the tokens forced after it), as vLLM's structured outputs wait for the reasoning's end
        matchers = [None if s.matcher is None or s.holds_grammar(p.thinking) else s.matcher
                    for s, p in zip(states, params, strict=True)]
        if any(m is not None for m in matchers):
            # float32 first (the sampler's dtype; a copy when the runner's logits are half precision)
            logits = apply_grammar_masks(logits.float(), matchers)
        token_ids, logprobs = self.sampler.sample(logits, params, generators, histories(requests))
        for i, (p, state) in enumerate(zip(params, states, strict=True)):
            if (forced := state.force_thinking_end(p.thinking)) is not None:
                token_ids[i] = forced  # a spent thinking budget: close the block (the sampled token is dropped)
        for matcher, token_id in zip(matchers, token_ids, strict=True):
            if matcher is not None and not matcher.is_terminated():
                matcher.accept_token(token_id)
        return dict(zip(request_ids, token_ids, strict=True)), logprobs_by_request(request_ids, logprobs)

    def _plain_step(self, plan: SchedulerOutput, logits: torch.Tensor,
                    now: Callable[[], float]) -> list[RequestOutput]:
        """The step's sampling and bookkeeping without speculation (logits: one row per sampled seq)."""
        sampled, token_logprobs = self._sample(logits, [s.request_id for s in plan.scheduled if s.needs_logits])
        t = now()
        updated = self.scheduler.update_from_output(plan, sampled, t)
        self._throughput.add(t, plan.num_prefill_tokens, plan.num_decode_tokens)
        self.iteration_tokens.observe(plan.num_prefill_tokens + plan.num_decode_tokens)
        outputs = []
        for request in updated:
            rid = request.request_id
            if rid not in sampled:
                continue  # a prefill chunk that is not the last: nothing to say yet
            outputs.append(self._emit_token(request, sampled[rid], t, token_logprobs.get(rid)))
        return outputs

    def _speculative_step(self, plan: SchedulerOutput, logits: torch.Tensor, now: Callable[[], float],
                          speculator: Speculator) -> list[RequestOutput]:
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
        token_logprobs: dict[str, TokenLogprobs] = {}
        if plain_ids:
            sampled, token_logprobs = self._sample(logits if len(plain_rows) == row else logits[plain_rows],
                                                   plain_ids)
        accepted: dict[str, list[int]] = {}
        run_logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
        scans: dict[str, tuple[str, bool]] = {}
        for seq, first_row in spec_seqs:
            request = self.scheduler.get_request(seq.request_id)
            assert request is not None
            tokens = speculator.verify(request, seq.token_ids[-seq.num_draft_tokens:],
                                       logits[first_row : first_row + 1 + seq.num_draft_tokens],
                                       self._generator(seq.request_id))
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
        self.iteration_tokens.observe(plan.num_prefill_tokens + plan.num_decode_tokens + num_extra)
        outputs = []
        for request in updated:
            rid = request.request_id
            if rid in accepted:
                text, is_stopped = scans[rid]
                outputs.append(self._emit(request, accepted[rid], text, is_stopped, t, run_logprobs.get(rid)))
            elif rid in sampled:
                outputs.append(self._emit_token(request, sampled[rid], t, token_logprobs.get(rid)))
        return outputs

    # ---- what a step emits ---------------------------------------------------------------------------

    def _emit_token(self, request: Request, token_id: int, now: float,
                    logprob: TokenLogprobs | None = None) -> RequestOutput:
        """:meth:`_emit` for one sampled token, detokenized and scanned here (the scheduler has taken it)."""
        state = self._states[request.request_id]
        finished_by_token = request.is_finished and request.finish_reason == "stop"
        delta = "" if finished_by_token else state.detokenizer.push(token_id)
        if request.num_output_tokens <= request.sampling_params.min_tokens:
            text, is_stopped = delta, False  # min_tokens: stop strings count only in the text after it
        else:
            scan = state.stop_checker.feed(delta)
            text, is_stopped = scan.text_to_emit, scan.is_stopped
        return self._emit(request, (token_id,), text, is_stopped, now, None if logprob is None else (logprob,))

    def _scan_run(self, request: Request, tokens: Sequence[int], skip_last: bool) -> tuple[int, str, bool]:
        """Detokenize an accepted run and scan it for stop strings, token by token, as one-token steps
        would: ``(tokens to keep, text to emit, stopped by a stop string)``. ``skip_last``: the last
        token is a stop token id (EOS …), which is not detokenized (as in :meth:`_emit_token`)."""
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

    def _emit(self, request: Request, tokens: Sequence[int], text: str, is_stopped: bool,
              now: float, logprobs: tuple[TokenLogprobs, ...] | None = None) -> RequestOutput:
        """The output for tokens already detokenized and scanned (one token or an accepted run): finish
        the request on a stop string, flush its text when it finished, and count the tokens."""
        state = self._states[request.request_id]
        self.output_tokens_total += len(tokens)
        state.follow_thinking(request.sampling_params.thinking, tokens)
        if tokens:
            # the first emission is the time to first token; each later one is a gap (vLLM's inter-token latency)
            if request.last_token_s is not None:
                self.inter_token_latency.observe(now - request.last_token_s)
            request.last_token_s = now
        if state.matcher is not None and state.matcher.is_terminated() and not request.is_finished:
            # the grammar is complete (it accepted a stop id, or nothing may follow): the reply ends here,
            # also with ignore_eos, since no further token would be valid
            self.scheduler.finish_request(request.request_id, "stop", now)
        if is_stopped and not request.is_finished:
            self.scheduler.finish_request(request.request_id, "stop", now)
        if request.is_finished:
            if not is_stopped:
                text += state.stop_checker.feed(state.detokenizer.flush()).text_to_emit
                text += state.stop_checker.flush()
            del self._states[request.request_id]
        return self._output(request, text, tuple(tokens), now, logprobs, state.num_reasoning_tokens)

    def _output(self, request: Request, text: str, token_ids: tuple[int, ...], now: float,
                logprobs: tuple[TokenLogprobs, ...] | None = None, num_reasoning_tokens: int = 0) -> RequestOutput:
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
            logprobs=logprobs, max_tokens=request.sampling_params.max_tokens,
            num_reasoning_tokens=num_reasoning_tokens,
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
            spec=self.speculator.counters.snapshot() if self.speculator is not None else None,
            iteration_tokens=self.iteration_tokens.copy(), inter_token_latency=self.inter_token_latency.copy(),
        )

    def _quant_note(self) -> str:
        quant = self.model_config.quant
        mode = resolve_quant_dequant(self.config.quant_dequant, self.backend)
        return "" if quant is None else f" ({quant.method}, dequantised {mode})"

    def describe(self) -> str:
        gib = self.free_memory_bytes / 2**30
        where = "VRAM" if self.device.type == "cuda" else "RAM"
        return (
            f"model {self.model_id} ({self.model_config.architecture}, "
            f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M params) on {self.device}; "
            f"weights {self.model.weight_bytes() / 2**20:.1f} MiB{self._quant_note()}; "
            f"free {where} {gib:.1f} GiB; KV capacity {self.kv_capacity_tokens} tokens "
            f"({self.config.kv_dtype}, {math.ceil(self.kv_cache.nbytes / 2**20)} MiB); "
            f"lanes {self.config.max_concurrency}; queue {self.config.max_pending_requests}; "
            f"max context {self.max_context}; CUDA graphs {self.cuda_graphs}; "
            f"stream interval {self.config.stream_interval_ms:g} ms"
            f"{self.speculator.describe() if self.speculator is not None else ''}"
            f"{self._fp8_cpu_note()}"
        )

    def _fp8_cpu_note(self) -> str:
        """fp8 KV on the CPU trades speed for capacity: say how much (issue #30: ~25x slower without a word)."""
        if self.config.kv_dtype != "fp8" or self.device.type != "cpu":
            return ""
        spec = self.kv_cache.spec
        gain = spec.dtype.itemsize / spec.storage_dtype.itemsize
        return (f"; NOTE fp8 KV on the CPU holds {gain:g}x the tokens of {str(spec.dtype).removeprefix('torch.')} "
                f"in the same memory but decodes without the compiled CPU kernels: about "
                f"{CPU_FP8_DECODE_SLOWDOWN:g}x slower at concurrency 1 (measured with bench/kv_dtype.py, "
                f"docs/benchmarks.md); use --kv-dtype auto unless capacity matters more than speed")
