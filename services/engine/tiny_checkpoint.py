"""Tiny random-weight HF checkpoints for tests and the demo stack.

``write_tiny_checkpoint`` writes a directory that both this engine and ``transformers`` load:
``config.json`` (the transformers-4 layout real Llama/Qwen checkpoints ship), ``model.safetensors`` (or
``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``), ``tokenizer.json``,
``tokenizer_config.json`` (with a ChatML chat template) and ``generation_config.json``.

Determinism: the weights come from a ``torch.Generator`` seeded with ``seed`` and drawn in a fixed order;
the tokenizer is a byte-level BPE trained on the docstrings of Python's builtins (sorted by name) plus a
fixed multilingual line, so the same interpreter version always produces byte-identical files.

Scale: linear weights are N(0, 1/fan_in) (activations stay O(1) through the layers), embeddings N(0, 0.5²)
or, when tied, N(0, 0.1²) (see ``_weights``), so greedy outputs vary across prompts and steps; norm
weights 1 + N(0, 0.1²) so a norm that ignored its weight would be caught.

CLI: ``python -m services.engine.tiny_checkpoint OUT_DIR [--arch qwen3] [--hidden-size 64] …``
"""

from __future__ import annotations

import argparse
import builtins
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Trained as special tokens (skipped when decoding with skip_special_tokens), in this id order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added as ordinary tokens, as Qwen3 does, so reasoning text decodes with its tags.
THINK_TOKENS = ("<think>", "</think>")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role ' ~ message['role'] | tojson) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_EXTRA_CORPUS = "héllo wörld, ça va? 世界你好。 Привет, мир! 🎉 <think>reasoning</think> The answer is 42.\n"


def _corpus() -> list[str]:
    docs = []
    for name in sorted(dir(builtins)):
        doc = getattr(getattr(builtins, name), "__doc__", None)
        if isinstance(doc, str) and doc not in docs:
            docs.append(doc)
    return [*docs, _EXTRA_CORPUS]


def build_tokenizer(vocab_size: int, corpus: Iterable[str] | None = None) -> Tokenizer:
    """A byte-level BPE with exactly ``vocab_size`` tokens, trained on ``corpus`` (default: a fixed text, the
    builtins' docstrings): ids 0-2 are SPECIAL_TOKENS, the last two are THINK_TOKENS (ordinary added tokens,
    as Qwen3 has them); if the corpus runs out of merges, ``<|reserved_N|>`` special tokens fill the gap."""
    minimum = 256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be at least {minimum} (256 bytes + 5 special tokens), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus() if corpus is None else corpus, trainer)
    shortfall = vocab_size - len(THINK_TOKENS) - tokenizer.get_vocab_size()
    if shortfall > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(shortfall)])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    return tokenizer


@dataclass(frozen=True)
class ModelSizes:
    """The shape of a checkpoint's model, what :func:`hf_config` writes into config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool


def hf_config(
    arch: str,
    sizes: ModelSizes,
    *,
    dtype: str,
    rope_scaling: dict[str, object] | None,
    max_position_embeddings: int,
    bos_token_id: int,
    eos_token_id: int,
) -> dict[str, object]:
    """The config.json of an ``arch`` model (a key of ARCHITECTURES) of ``sizes``, in the transformers layout."""
    config: dict[str, object] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "hidden_size": sizes.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": sizes.intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": sizes.num_heads,
        "num_hidden_layers": sizes.num_layers,
        "num_key_value_heads": sizes.num_kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": rope_scaling,
        "rope_theta": 10000.0 if arch == "llama" else 1000000.0,
        "tie_word_embeddings": sizes.tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": sizes.vocab_size,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, head_dim=sizes.head_dim, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=sizes.num_layers)
    if arch == "qwen3":
        config.update(attention_bias=False, head_dim=sizes.head_dim)
    return config


def _weights(arch: str, sizes: ModelSizes, seed: int, mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * cols**-0.5

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    def bias(size: int) -> torch.Tensor:
        return 0.1 * torch.randn(size, generator=gen)

    h, head_dim, inter = sizes.hidden_size, sizes.head_dim, sizes.intermediate_size
    q_size, kv_size = sizes.num_heads * head_dim, sizes.num_kv_heads * head_dim
    # Measured on 3 prompts x 16 greedy tokens: untied std 0.5 gives 11-16 distinct tokens per run (0.1
    # often collapses to one repeated token); tied needs 0.1, since larger embeddings make the LM head
    # answer "the input token again" every step.
    embed_std = 0.1 if sizes.tie_word_embeddings else 0.5
    tensors = {"model.embed_tokens.weight": embed_std * torch.randn(sizes.vocab_size, h, generator=gen)}
    def layer(p: str) -> None:
        tensors[f"{p}.input_layernorm.weight"] = norm(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = norm(h)
        tensors[f"{p}.self_attn.q_proj.weight"] = linear(q_size, h)
        tensors[f"{p}.self_attn.k_proj.weight"] = linear(kv_size, h)
        tensors[f"{p}.self_attn.v_proj.weight"] = linear(kv_size, h)
        if arch == "qwen2":
            tensors[f"{p}.self_attn.q_proj.bias"] = bias(q_size)
            tensors[f"{p}.self_attn.k_proj.bias"] = bias(kv_size)
            tensors[f"{p}.self_attn.v_proj.bias"] = bias(kv_size)
        tensors[f"{p}.self_attn.o_proj.weight"] = linear(h, q_size)
        if arch == "qwen3":
            tensors[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)
            tensors[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)
        tensors[f"{p}.mlp.gate_proj.weight"] = linear(inter, h)
        tensors[f"{p}.mlp.up_proj.weight"] = linear(inter, h)
        tensors[f"{p}.mlp.down_proj.weight"] = linear(h, inter)
    for i in range(sizes.num_layers):
        layer(f"model.layers.{i}")
    tensors["model.norm.weight"] = norm(h)
    if not sizes.tie_word_embeddings:
        tensors["lm_head.weight"] = linear(sizes.vocab_size, h)
    # Drawn last, so the model's own tensors are the same with or without an MTP module.
    if mtp_layers:
        tensors["mtp.pre_fc_norm_embedding.weight"] = norm(h)
        tensors["mtp.pre_fc_norm_hidden.weight"] = norm(h)
        tensors["mtp.fc.weight"] = linear(h, 2 * h)
        layer("mtp.layers.0")
        tensors["mtp.norm.weight"] = norm(h)
    return tensors


def _save(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[shard * per_shard : (shard + 1) * per_shard]}
        save_file(chunk, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    num_shards: int = 1,
    rope_scaling: dict[str, object] | None = None,
    max_position_embeddings: int = 4096,
    mtp_layers: int = 0,
) -> Path:
    """Write a random-weight checkpoint of family ``arch`` ("llama" | "qwen2" | "qwen3") into ``path``
    (created if needed) and return it. ``head_dim`` defaults to hidden_size // num_heads; Llama and Qwen3
    record it in config.json, Qwen2 cannot (its config has no such key), so Qwen2 ignores the argument.

    ``mtp_layers=1`` adds a random multi-token-prediction module (``mtp.*`` tensors, Qwen3-Next naming, see
    ``mtp_head``) and its config key: ``mtp_num_hidden_layers`` (Qwen3-Next's) for qwen3,
    ``num_nextn_predict_layers`` (DeepSeek's) otherwise, so both spellings get exercised."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if mtp_layers not in (0, 1):
        raise ValueError(f"mtp_layers must be 0 or 1, got {mtp_layers}")
    if arch == "qwen2" or head_dim is None:
        head_dim = hidden_size // num_heads
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size)
    bos_id, eos_id = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    if bos_id is None or eos_id is None:
        raise AssertionError("build_tokenizer always adds <|endoftext|> and <|im_end|>")
    sizes = ModelSizes(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    config = hf_config(
        arch,
        sizes,
        dtype=dtype,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if mtp_layers:
        config["mtp_num_hidden_layers" if arch == "qwen3" else "num_nextn_predict_layers"] = mtp_layers
    tensors = _weights(arch, sizes, seed, mtp_layers)
    tensors = {name: t.to(_DTYPES[dtype]).contiguous() for name, t in tensors.items()}

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _save(tensors, out, num_shards)
    write_tokenizer_files(out, tokenizer, max_position_embeddings, eot_id=bos_id, im_end_id=eos_id)
    return out


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, model_max_length: int, *, eot_id: int,
                          im_end_id: int) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json (stop on
    ``<|im_end|>`` and ``<|endoftext|>``): the files every checkpoint this project writes shares."""
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation_config = {"bos_token_id": eot_id, "eos_token_id": [im_end_id, eot_id], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def mirror_mtp(path: str | Path, *, exact: bool = True) -> Path:
    """Rewrite the MTP module of a single-file checkpoint (written with ``mtp_layers=1``) into a copy of the
    model's first layer, so that it predicts what the model will say next.

    The MTP gets a copy of layer 0 and of the final norm, and an ``fc`` that keeps the normed embedding and
    drops the hidden state (``[I | 0]``). Its row ``p`` then runs the model's first layer over the tokens
    ``x[1] .. x[p + 1]`` (RoPE is relative, so the shift by one position does not matter), i.e. it guesses
    ``x[p + 2]`` as a one-layer truncation of the model would, except that ``x[0]`` is out of its view.

    ``exact`` (one-layer, untied checkpoints only) makes the guess exact: the model's attention output is
    zeroed (its next token then depends on the current token only), embeddings are scaled to RMS 1 and the
    norm before ``fc`` gets unit weights (so it is the identity up to its epsilon): every greedy draft is
    accepted. Otherwise the model is left untouched and that norm's weight is the embeddings' mean RMS, an
    approximation. Either way this is a construction: it says nothing about a trained head's acceptance."""
    from safetensors.torch import load_file

    out = Path(path)
    config = json.loads((out / "config.json").read_text())
    if exact and (config["num_hidden_layers"] != 1 or config.get("tie_word_embeddings")):
        raise ValueError("mirror_mtp(exact=True) needs a one-layer checkpoint with an untied LM head")
    tensors = load_file(str(out / "model.safetensors"))
    if "mtp.fc.weight" not in tensors:
        raise ValueError(f"{out} has no MTP module (write it with mtp_layers=1)")
    h = int(config["hidden_size"])
    dtype = tensors["mtp.fc.weight"].dtype
    embed = tensors["model.embed_tokens.weight"]
    rms = embed.float().pow(2).mean(-1, keepdim=True).sqrt()
    if exact:
        tensors["model.embed_tokens.weight"] = (embed.float() / rms).to(embed.dtype)
        o_proj = "model.layers.0.self_attn.o_proj.weight"
        tensors[o_proj] = torch.zeros_like(tensors[o_proj])
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.ones(h, dtype=dtype)
    else:
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.full((h,), float(rms.mean()), dtype=dtype)
    for name in [n for n in tensors if n.startswith("model.layers.0.")]:
        tensors["mtp.layers.0." + name.removeprefix("model.layers.0.")] = tensors[name].clone()
    tensors["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1).to(dtype)
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight HF checkpoint.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--mtp-layers", type=int, choices=[0, 1], default=0,
                        help="add a random MTP module (mtp.* tensors) for --spec mtp")
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(
        args.out_dir,
        args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_word_embeddings,
        dtype=args.dtype,
        seed=args.seed,
        num_shards=args.num_shards,
        mtp_layers=args.mtp_layers,
    )
    print(path)


if __name__ == "__main__":
    main()
