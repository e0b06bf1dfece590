"""Speculative decoding on CPU: output tok/s with and without ngram / draft-model / MTP speculation (issue #11).

One process: write a random-weight Qwen3 target (and, for ``--spec draft``, a draft made of the target's
first layers, see :func:`write_pair`), then for each concurrency (1 and 8) time ``LLM.generate`` over the
same prompts with speculation off, ``ngram`` and ``draft``, greedy, EOS ignored, ``--output-tokens`` each.
Throughput is output tokens / wall seconds of the whole call (prefill included). Each configuration
is warmed up once, then timed ``--repeats`` times *interleaved* (off, ngram, draft, off, ngram, …) so
that load from other processes on a shared machine hits every configuration alike; the median is
reported, with the acceptance figures from the engine's own counters (the /usage "speculative" ones).

Workload: "repetitive" prompts, the token ids of a small code file's text repeated with variations
(the tiny tokenizer's ids), so prompt lookup has something to find. What is measured is the engine's
mechanism: the target weights are random, so the *outputs* are whatever the random model does (random
models fall into loops, which n-gram lookup exploits); a trained model on real text has other acceptance
rates. The draft pair is synthetic: the target's layers past the draft's are damped (their output
projections scaled by ``--damp``), so the truncated model agrees with the target often, as a trained
draft of the same family would. Its acceptance rate is a property of that construction, not a claim
about real draft models.

MTP: the target also carries a random ``mtp.*`` module (drawn after the model's own weights, which are
therefore unchanged), so the "random MTP" row measures the MTP's cost with drafts that are essentially never
accepted. The "first-layer MTP" row runs a copy of the same target whose MTP module is rewritten into the
target's own first layer (``tiny_checkpoint.mirror_mtp(exact=False)``: ``fc`` keeps the embedding and drops
the hidden state), i.e. an MTP that behaves like the one-layer draft above minus the first token of the
context. Neither says anything about a trained MTP head's acceptance.

Usage: ``python -m bench.spec_decode [--quick] [--markdown] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.engine.llm import LLM, greedy
from services.engine.spec.spec_decode import SpecConfig, SpecDecodeStats
from services.engine.tiny_checkpoint import mirror_mtp, write_tiny_checkpoint

CODE = '''def fib(n):
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


def total(values):
    result = 0
    for value in values:
        result = result + value
    return result


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y
'''


@dataclass(frozen=True)
class Shape:
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1536
    vocab_size: int = 8192
    draft_layers: int = 1


def write_pair(root: Path, shape: Shape, damp: float) -> tuple[Path, Path]:
    """A target checkpoint and a draft made of its first ``draft_layers`` layers (same tokenizer, same
    embeddings, norm and LM head); the target's later layers have their o_proj / down_proj scaled by
    ``damp`` so they perturb the residual stream only a little."""
    target = write_tiny_checkpoint(root / "target", "qwen3", hidden_size=shape.hidden_size,
                                   num_layers=shape.num_layers, num_heads=shape.num_heads,
                                   num_kv_heads=shape.num_kv_heads, intermediate_size=shape.intermediate_size,
                                   vocab_size=shape.vocab_size, mtp_layers=1)
    tensors = load_file(str(target / "model.safetensors"))
    for name in tensors:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= shape.draft_layers and (
            name.endswith(("o_proj.weight", "down_proj.weight"))
        ):
            tensors[name] = tensors[name] * damp
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    draft = root / "draft"
    draft.mkdir()
    for f in target.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (draft / f.name).write_bytes(f.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = shape.draft_layers
    (draft / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    kept = {n: t for n, t in tensors.items() if not n.startswith("mtp.") and (
        not n.startswith("model.layers.") or int(n.split(".")[2]) < shape.draft_layers)}
    save_file(kept, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return target, draft


def write_first_layer_mtp(root: Path, target: Path) -> Path:
    """A copy of ``target`` (same model weights) whose MTP module is the target's first layer (see the top)."""
    out = root / "target-first-layer-mtp"
    out.mkdir()
    for f in target.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return mirror_mtp(out, exact=False)


def prompts_for(llm: LLM, num_prompts: int) -> list[list[int]]:
    base = llm.tokenizer.encode(CODE)
    out = []
    for i in range(num_prompts):
        # Each prompt: the code, then its first (16 + 4 i) tokens again, so prompts differ in length and end.
        out.append(base + base[: 16 + 4 * i])
    return out


@dataclass
class Result:
    method: str
    concurrency: int
    tok_per_s: list[float]
    spec: SpecDecodeStats | None
    tokens: list[tuple[int, ...]]
    baseline: str = "off"  # the row its speedup is relative to


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (a smoke run)")
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--damp", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.output_tokens, args.repeats = 32, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = Shape()
    k = args.draft_tokens
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = write_pair(Path(tmp), shape, args.damp)
        first_layer_mtp = write_first_layer_mtp(Path(tmp), target)
        specs = {  # name -> (checkpoint, speculation, baseline row)
            "off": (target, SpecConfig(), "off"),
            f"ngram K={k}": (target, SpecConfig(method="ngram", num_draft_tokens=k), "off"),
            f"draft K={k}": (target, SpecConfig(method="draft", num_draft_tokens=k, draft_model_path=draft), "off"),
            f"mtp K={k} (random MTP)": (target, SpecConfig(method="mtp", num_draft_tokens=k), "off"),
            f"mtp K={k} (first-layer MTP)": (first_layer_mtp, SpecConfig(method="mtp", num_draft_tokens=k), "off"),
        }
        results: list[Result] = []
        for concurrency in (1, 8):
            engines = {name: LLM(path, kv_capacity_tokens=16384, max_concurrency=concurrency, spec=spec)
                       for name, (path, spec, _) in specs.items()}
            prompts = prompts_for(next(iter(engines.values())), 8 if concurrency > 1 else 2)
            params = greedy(args.output_tokens, ignore_eos=True)
            rows = {name: Result(name, concurrency, [], None, [], specs[name][2]) for name in engines}
            for name, llm in engines.items():  # warm-up, and the outputs the off run must match
                rows[name].tokens = [c.token_ids for c in llm.generate(prompts, params)]
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    t0 = time.perf_counter()
                    llm.generate(prompts, params)
                    rows[name].tok_per_s.append(len(prompts) * args.output_tokens / (time.perf_counter() - t0))
            for name, llm in engines.items():
                rows[name].spec = llm.core.snapshot(time.monotonic()).spec
                assert rows[name].tokens == rows[rows[name].baseline].tokens, f"{name}: greedy output differs"
                results.append(rows[name])
    report(results, shape, args)


def report(results: list[Result], shape: Shape, args: argparse.Namespace) -> None:
    head = (f"Qwen3 target {shape.num_layers} layers x {shape.hidden_size}, vocab {shape.vocab_size}; draft = its "
            f"first {shape.draft_layers} layer(s), later layers damped x{args.damp}; MTP module random "
            f"or the target's first layer; {args.output_tokens} greedy "
            f"output tokens per request; median of {args.repeats} interleaved runs; torch threads "
            f"{torch.get_num_threads()}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(head)
    base = {(r.concurrency, r.method): statistics.median(r.tok_per_s) for r in results}
    if args.markdown:
        print("\n| concurrency | speculation | tok/s (median) | runs | speedup | acceptance | mean tokens/step "
              "| accepted per position |")
        print("|---:|---|---:|---|---:|---:|---:|---|")
    for r in results:
        med = statistics.median(r.tok_per_s)
        runs = ", ".join(f"{x:.0f}" for x in r.tok_per_s)
        s = r.spec
        acc = f"{100 * s.acceptance_rate:.1f} %" if s else "-"
        mal = f"{s.mean_acceptance_length:.2f}" if s else "1"
        per_pos = "-"
        if s and s.num_drafts:
            per_pos = ", ".join(f"{n / s.num_drafts:.2f}" for n in s.num_accepted_tokens_per_pos)
        speedup = med / base[(r.concurrency, r.baseline)]
        if args.markdown:
            print(f"| {r.concurrency} | {r.method} | {med:.1f} | {runs} | {speedup:.2f}x | {acc} | {mal} | {per_pos} |")
        else:
            print(f"C={r.concurrency:<2} {r.method:<26} {med:8.1f} tok/s  [{runs}]  x{speedup:.2f}  acceptance {acc}  "
                  f"tokens/step {mal}  per position [{per_pos}]")


if __name__ == "__main__":
    main()
