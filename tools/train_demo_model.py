"""Train the demo model that ``llmgw up`` serves by default (``models/demo-qwen3``).

A ~4M-parameter Qwen3-architecture causal LM plus a 4096-token byte-level BPE, trained from scratch on CPU
in one thread, so that ``make up`` on a laptop with no network serves text rather than noise.

Corpus (offline, redistributable): everything comes from the running interpreter's own standard library,
which is distributed under the Python Software Foundation License Version 2 (https://docs.python.org/3/license.html):

* the docstrings (module, class, function) of every ``.py`` file under ``sysconfig``'s stdlib path,
  skipping ``site-packages`` and test suites, in sorted path order and ``ast.walk`` order;
* ``pydoc_data.topics`` (the language reference topics that ``help()`` prints), in sorted key order;
* short chat exchanges built from the same docstrings ("What does json.dumps do?" → the docstring's first
  paragraph), so the chat template served by the gateway leads somewhere sensible.

Each document goes to the held-out validation split when ``crc32(key) % 20 == 0`` (about 5%), so the
split does not move when documents are added. The tokenizer is trained on the training split only.

Determinism: ``torch.manual_seed(seed)`` fixes the initial weights; the data order is a pure function of
(seed, step) (one seeded permutation of fixed-length windows per epoch), so a run resumed from any
checkpoint takes the same batches as an uninterrupted one. On one machine and torch version the result is
reproducible; other CPUs may differ in the last float bits.

Resumable: the model, optimizer, step, accumulated wall time and loss history are saved to
``WORK_DIR/state.pt`` every ``--checkpoint-every`` steps; ``--resume`` continues from there, and refuses
(naming each difference) a state saved with other training settings or another model shape.

Threads: ``torch.set_num_threads(1)`` by default; the machines this runs on are shared.

Usage (from the repo root; needs only the runtime dependencies)::

    .venv/bin/python tools/train_demo_model.py [--work-dir data/train-demo] [--out models/demo-qwen3] [--resume]

At the end the checkpoint is exported in the HF layout (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``), reloaded with this repo's engine
(``services.engine.llm.LLM``), and ``README.md`` (the model card) is written from the measured numbers and
the engine's own greedy completions.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm

from services.engine.tiny_checkpoint import ModelSizes, build_tokenizer, hf_config, write_tokenizer_files

REPO_ROOT = Path(__file__).resolve().parents[1]
VAL_MODULUS = 20  # 1 document in 20 is held out
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "lib2to3", "turtledemo"})
MAX_ANSWER_CHARS = 400
QUESTIONS = {"function": "What does {name} do?", "class": "What is {name}?", "module": "What is the {name} module for?"}
CARD_PROMPTS = (
    "Return the",
    "The default value is",
    "This module provides",
    "If the file does not exist,",
    "class Queue:\n    \"\"\"",
)
CARD_CHATS = ("What does os.path.join do?", "What is the json module for?", "hi")


# --- corpus -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    key: str  # stable identity, decides the split
    text: str


def _docstrings(root: Path) -> list[tuple[str, str, str]]:
    """(qualified name, kind, docstring) for every documented module, class and function under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_DIRS.intersection(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):  # a few stdlib files are deliberately broken test data
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        names: dict[ast.AST, str] = {tree: module}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    names[child] = f"{names.get(node, module)}.{child.name}"
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 20:
                kind = {ast.Module: "module", ast.ClassDef: "class"}.get(type(node), "function")
                found.append((names[node], kind, doc))
    return found


def _chat(name: str, kind: str, doc: str) -> str | None:
    """A one-turn exchange about a public name, answered with the docstring's first paragraph."""
    if any(part.startswith("_") for part in name.split(".")):
        return None
    answer = " ".join(doc.split("\n\n", 1)[0].split())
    if not answer or len(answer) > MAX_ANSWER_CHARS or ">>>" in answer:
        return None
    question = QUESTIONS[kind].format(name=name)
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def build_corpus() -> list[Document]:
    """The documents, in a fixed order (see the module docstring); exact duplicates keep their first key."""
    import pydoc_data.topics

    docs: list[Document] = []
    seen: set[str] = set()

    def add(key: str, text: str) -> None:
        if text not in seen:
            seen.add(text)
            docs.append(Document(key, text))

    found = _docstrings(Path(sysconfig.get_paths()["stdlib"]))
    for name, _kind, doc in found:
        add(f"doc:{name}", doc)
    for key in sorted(pydoc_data.topics.topics):
        add(f"topic:{key}", pydoc_data.topics.topics[key].strip())
    for name, kind, doc in found:
        chat = _chat(name, kind, doc)
        if chat is not None:
            add(f"chat:{name}", chat)
    return docs


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    val = [d for d in docs if zlib.crc32(d.key.encode()) % VAL_MODULUS == 0]
    train = [d for d in docs if zlib.crc32(d.key.encode()) % VAL_MODULUS != 0]
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """``tiny_checkpoint.build_tokenizer`` on ``texts``, refused when the corpus runs out of merges: a demo
    model should not spend rows of its embedding on the ``<|reserved_N|>`` tokens that would pad the gap."""
    tokenizer = build_tokenizer(vocab_size, corpus=texts)
    num_padding = sum(t.special and t.content.startswith("<|reserved_")
                      for t in tokenizer.get_added_tokens_decoder().values())
    if num_padding:
        raise RuntimeError(f"corpus too small for {vocab_size} tokens: got {vocab_size - num_padding}")
    return tokenizer


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of ``token``, which the tokenizers ``build_tokenizer`` makes always have."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise RuntimeError(f"the tokenizer has no {token!r}")
    return found


def encode(tokenizer: Tokenizer, docs: list[Document]) -> torch.Tensor:
    """One token stream: each document followed by ``<|endoftext|>``."""
    eot = token_id(tokenizer, "<|endoftext|>")
    ids: list[int] = []
    for enc in tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


# --- model --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rope_theta: float = 1000000.0  # what tiny_checkpoint.hf_config writes for qwen3
    rms_norm_eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.s.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.s.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.s.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Qwen3LM(nn.Module):
    """Qwen3ForCausalLM for training only, with tied embeddings: its ``state_dict`` names are HF's
    (``model.layers.N.self_attn.q_proj.weight`` …), so export is a plain save."""

    inv_freq: torch.Tensor  # RoPE inverse frequencies (a non-persistent buffer)

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.model = Backbone(s)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2's scaled init for the projections that write into the residual stream.
                residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * s.num_layers) if residual else 1.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        freqs = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T


# --- training -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 1500
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    checkpoint_every: int = 100
    max_eval_windows: int = 256


def lr_at(step: int, c: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(stream: torch.Tensor, step: int, c: TrainConfig) -> torch.Tensor:
    """The ``[batch, seq_len + 1]`` windows of ``step``: a pure function of (seed, step). Each epoch cuts the
    stream into windows at a seeded offset and visits them in a seeded permutation."""
    window = c.seq_len + 1
    per_epoch = (len(stream) - window) // window
    rows = []
    for i in range(step * c.batch_size, (step + 1) * c.batch_size):
        epoch, index = divmod(i, per_epoch)
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + epoch)
        offset = int(torch.randint(0, window, (1,), generator=gen))
        start = offset + int(torch.randperm(per_epoch, generator=gen)[index]) * window
        rows.append(stream[start : start + window])
    return torch.stack(rows).long()


@torch.no_grad()
def evaluate(model: Qwen3LM, stream: torch.Tensor, c: TrainConfig) -> float:
    """Mean next-token cross-entropy (nats) over the first ``max_eval_windows`` disjoint windows."""
    model.eval()
    window = c.seq_len + 1
    n = min(c.max_eval_windows, len(stream) // window)
    windows = stream[: n * window].view(n, window).long()
    total = 0.0
    for chunk in windows.split(c.batch_size):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / (n * c.seq_len)


def resume_mismatch(state: dict[str, Any], c: TrainConfig, shape: Shape) -> list[str]:
    """How the run that saved ``state`` differs from this one, as "name saved (this run: value)" phrases; empty
    when it may be resumed. Both the training config and the model's shape count: a changed ``--lr`` would
    silently splice two schedules, a changed ``--vocab-size`` would fail inside ``load_state_dict``. States
    saved before the shape was recorded are checked by their tensors' shapes instead."""
    wanted: dict[str, object] = {**asdict(c), **asdict(shape)}
    made = {**state["train_config"], **state.get("shape", {})}
    differences = [f"{name} {made[name]!r} (this run: {value!r})" for name, value in wanted.items()
                   if name in made and made[name] != value]
    if "shape" not in state:
        with torch.device("meta"):  # shapes only: allocates nothing
            ours = {name: tuple(t.shape) for name, t in Qwen3LM(shape).state_dict().items()}
        saved = {name: tuple(t.shape) for name, t in state["model"].items()}
        differences += [f"{name} {saved.get(name)} (this run: {ours.get(name)})"
                        for name in sorted(ours.keys() | saved.keys()) if ours.get(name) != saved.get(name)]
    return differences


def _save_state(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill mid-save leaves the previous checkpoint intact


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.threads == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # tokenizers' Rayon pool would take every core
    c = TrainConfig(seed=args.seed, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                    checkpoint_every=args.checkpoint_every, eval_every=args.eval_every)
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.pt"
    shape = Shape(vocab_size=args.vocab_size)
    # Checked before the corpus is built (15 s on 2 cores for the stdlib alone), so a wrong flag fails at once.
    state = torch.load(state_path, weights_only=False) if args.resume and state_path.exists() else None
    if state is not None:
        differences = resume_mismatch(state, c, shape)
        if differences:
            raise SystemExit(f"--resume: {state_path} was made with a different configuration: "
                             f"{'; '.join(differences)}. Pass the same flags as that run, or train afresh "
                             "without --resume (or with another --work-dir).")

    docs = build_corpus()
    train_docs, val_docs = split(docs)
    tokenizer_path = work / "tokenizer.json"
    if args.resume and tokenizer_path.exists():
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        if tokenizer.get_vocab_size() != shape.vocab_size:
            raise SystemExit(f"--resume: {tokenizer_path} has {tokenizer.get_vocab_size()} tokens, not "
                             f"--vocab-size {shape.vocab_size}. Pass the same flags as that run, or train afresh "
                             "without --resume (or with another --work-dir).")
    else:
        tokenizer = train_tokenizer([d.text for d in train_docs], args.vocab_size)
        tokenizer.save(str(tokenizer_path))
    train_stream, val_stream = encode(tokenizer, train_docs), encode(tokenizer, val_docs)
    corpus = {
        "python": platform.python_version(),
        "documents": len(docs),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "train_chars": sum(len(d.text) for d in train_docs),
        "train_tokens": len(train_stream),
        "val_tokens": len(val_stream),
        "chat_documents": sum(d.key.startswith("chat:") for d in docs),
    }
    print(json.dumps(corpus), flush=True)

    torch.manual_seed(c.seed)
    model = Qwen3LM(shape)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=c.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    step, elapsed_s, history = 0, 0.0, []
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed_s, history = state["step"], state["elapsed_s"], state["history"]
        print(f"resumed at step {step} ({elapsed_s:.0f}s of training so far)", flush=True)

    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params:,} parameters; {c.steps} steps of {c.batch_size}x{c.seq_len} tokens", flush=True)
    model.train()
    bar = tqdm(total=c.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    while step < c.steps:
        started = time.perf_counter()
        lr = lr_at(step, c)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = batch_at(train_stream, step, c)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        step += 1
        elapsed_s += time.perf_counter() - started
        record: dict[str, float] = {"step": step, "loss": loss.item(), "lr": lr}
        if step % c.eval_every == 0 or step == c.steps:
            eval_started = time.perf_counter()
            record["val_loss"] = evaluate(model, val_stream, c)
            elapsed_s += time.perf_counter() - eval_started
            bar.write(f"step {step}: train loss {record['loss']:.3f}, val loss {record['val_loss']:.3f} "
                      f"(ppl {math.exp(record['val_loss']):.1f}), {elapsed_s:.0f}s")
        history.append(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}")
        bar.update(1)
        if step % c.checkpoint_every == 0 or step == c.steps:
            _save_state(state_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                     "elapsed_s": elapsed_s, "history": history, "train_config": asdict(c),
                                     "shape": asdict(shape)})
    bar.close()

    val_loss = next(r["val_loss"] for r in reversed(history) if "val_loss" in r)
    metrics = {
        "parameters": num_params,
        "shape": asdict(shape),
        "train_config": asdict(c),
        "corpus": corpus,
        "threads": args.threads,
        "train_wall_s": elapsed_s,
        "final_train_loss": sum(r["loss"] for r in history[-50:]) / len(history[-50:]),
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "val_curve": [(r["step"], r["val_loss"]) for r in history if "val_loss" in r],
        "machine": f"{platform.machine()} {_cpu_name()}, {os.cpu_count()} cores visible, torch {torch.__version__}",
    }
    (work / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    export(model, tokenizer, args.out)
    write_card(args.out, metrics)
    print(f"wrote {args.out}", flush=True)


# --- export -------------------------------------------------------------------------------------------


def export(model: Qwen3LM, tokenizer: Tokenizer, out: Path) -> None:
    """The HF checkpoint layout ``tiny_checkpoint`` writes, float32 weights."""
    s = model.s
    out.mkdir(parents=True, exist_ok=True)
    eot, im_end = token_id(tokenizer, "<|endoftext|>"), token_id(tokenizer, "<|im_end|>")
    sizes = ModelSizes(hidden_size=s.hidden_size, num_layers=s.num_layers, num_heads=s.num_heads,
                       num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate_size,
                       vocab_size=s.vocab_size, tie_word_embeddings=True)
    max_positions = 4096
    config = hf_config("qwen3", sizes, dtype="float32", rope_scaling=None, max_position_embeddings=max_positions,
                       bos_token_id=eot, eos_token_id=im_end)
    config["rope_theta"], config["rms_norm_eps"] = s.rope_theta, s.rms_norm_eps
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().float().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(out, tokenizer, max_positions, eot_id=eot, im_end_id=im_end)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _completions(out: Path, max_tokens: int = 32) -> list[tuple[str, str]]:
    """Greedy completions from this repo's engine: the card shows what ``llmgw up`` will serve."""
    from services.engine.llm import LLM, greedy

    llm = LLM(out, kv_capacity_tokens=4096, torch_threads=1)
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CARD_CHATS]
    prompts = [*CARD_PROMPTS, *chats]
    results = llm.generate(prompts, greedy(max_tokens))
    return [(p, r.text) for p, r in zip(prompts, results, strict=True)]


def write_card(out: Path, m: dict[str, Any]) -> None:
    c, corpus, shape = m["train_config"], m["corpus"], m["shape"]
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "README.md") / 1e6
    samples = "\n\n".join(
        f"```text\n{prompt}\u2502{text}\n```" for prompt, text in _completions(out)
    )
    curve = " · ".join(f"{step}: {loss:.3f}" for step, loss in m["val_curve"])
    tokens_seen = c["steps"] * c["batch_size"] * c["seq_len"]
    card = f"""# demo-qwen3

A {m['parameters'] / 1e6:.1f}M-parameter Qwen3-architecture causal LM trained from scratch on the Python
standard library's documentation, so that `make up` / `llmgw up` serves readable text with no network and
no download. It is a demo of the serving stack, not a useful assistant. Made by `tools/train_demo_model.py`
(rerun it to reproduce; the numbers below were written by that script from its own measurements).

## Corpus and licence

- The docstrings (modules, classes, functions) of CPython {corpus['python']}'s standard library `.py` files
  (test suites, `idlelib` tests, `lib2to3`, `turtledemo` and `site-packages` skipped), the language
  reference topics in `pydoc_data.topics`, and {corpus['chat_documents']:,} one-turn chat exchanges
  built from them ("What does json.dumps do?" answered with the docstring's first paragraph).
- Licence: the Python Software Foundation License Version 2, under which CPython and its documentation
  are distributed (https://docs.python.org/3/license.html). The weights are derived from that text; this
  checkpoint is redistributed with that notice.
- {corpus['documents']:,} documents; 1 in {VAL_MODULUS} held out by `crc32(key)`
  ({corpus['val_documents']:,} documents, {corpus['val_tokens']:,} tokens); training split
  {corpus['train_documents']:,} documents, {corpus['train_chars']:,} characters, {corpus['train_tokens']:,} tokens.

## Model

| | |
|---|---|
| architecture | `Qwen3ForCausalLM` (q/k RMSNorm, GQA, RoPE θ={shape['rope_theta']:g}, SwiGLU), tied embeddings |
| parameters | {m['parameters']:,} |
| layers x hidden | {shape['num_layers']} x {shape['hidden_size']}, MLP {shape['intermediate_size']} |
| attention | {shape['num_heads']} query heads, {shape['num_kv_heads']} KV heads, head_dim {shape['head_dim']} |
| tokenizer | byte-level BPE, {shape['vocab_size']:,} tokens (trained on the training split), ChatML chat template |
| weights | float32 safetensors, {size_mb:.1f} MB in this folder |
| trained context | {c['seq_len']} tokens (config says 4096; quality falls off beyond {c['seq_len']}) |

## Training

- {c['steps']:,} steps x {c['batch_size']} sequences x {c['seq_len']} tokens = {tokens_seen:,} tokens
  ({tokens_seen / corpus['train_tokens']:.1f} epochs), AdamW (β 0.9/0.95, weight decay {c['weight_decay']}),
  peak LR {c['lr']:g}, {c['warmup_steps']} warm-up steps then cosine to {c['min_lr_ratio']:g}x, grad clip
  {c['grad_clip']}, seed {c['seed']}.
- Wall time {m['train_wall_s'] / 60:.1f} min of training (evaluation included) on {m['threads']} thread(s):
  {m['machine']}.
- Final training loss (mean of the last 50 steps) {m['final_train_loss']:.3f}.
- **Validation loss {m['val_loss']:.3f} nats/token, perplexity {m['val_ppl']:.1f}** (held-out documents,
  first {c['max_eval_windows']} windows of {c['seq_len']} tokens). Curve (step: loss): {curve}.

## Greedy completions (this repo's engine, 32 new tokens, `│` marks where generation starts)

{samples}

## Limits

- It continues docstring-like English and Python snippets; facts, code and answers are often wrong or
  invented. It knows nothing outside the standard library's documentation.
- Chat is shallow: it was trained on one-turn "What does X do?" exchanges only, no system prompts, no
  multi-turn, no tools, no reasoning (`<think>` is in the vocabulary but never trained).
- Trained on {c['seq_len']}-token windows; longer prompts are served but degrade.
- English only; other scripts fall back to byte tokens the model has hardly seen.
- Memorisation: with a corpus this small it repeats training text verbatim, which is fine for PSF-licensed
  text but makes it a poor benchmark of anything but the serving stack.
"""
    (out / "README.md").write_text(card)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "data" / "train-demo",
                        help="checkpoints, tokenizer and metrics while training")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "demo-qwen3")
    parser.add_argument("--resume", action="store_true", help="continue from WORK_DIR/state.pt")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--vocab-size", type=int, default=Shape.vocab_size)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--checkpoint-every", type=int, default=TrainConfig.checkpoint_every)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: shared machines)")
    parser.add_argument("--card-only", action="store_true",
                        help="rewrite OUT/README.md from WORK_DIR/metrics.json without training")
    args = parser.parse_args(argv)
    if args.card_only:
        torch.set_num_threads(args.threads)
        write_card(args.out, json.loads((args.work_dir / "metrics.json").read_text()))
        return
    train(args)


if __name__ == "__main__":
    main()
