"""MTPHead: a checkpoint's multi-token-prediction module (DeepSeek-V3 / Qwen3-Next style), the math only.

Layout (Qwen3-Next naming, ``mtp.*`` tensors): ``pre_fc_norm_embedding`` and ``pre_fc_norm_hidden``
(RMSNorms), ``fc`` ``[H, 2H]``, one decoder layer ``layers.0`` named and shaped like the main model's
layers (q/k norms for Qwen3, q/k/v bias for Qwen2), and a final ``norm``. It has no embedding or LM head
of its own: it uses the main model's (``--lm-head-draft`` is therefore implied for ``--spec mtp``).

**One row** ``p`` (vLLM's ``EagleProposer`` convention, used for its DeepSeek and Qwen3-Next MTP): the
token *after* ``p`` and a hidden state *at* ``p``, at RoPE position ``p``::

    x = fc(cat(norm_emb(embed(x[p + 1])), norm_hidden(h[p])))
    g[p] = norm(decoder_layer(x, position p))      # K/V written at p in the MTP's own one-layer cache
    logits[p] = lm_head(g[p])                     # the MTP's guess for x[p + 2]

``h[p]`` is the main model's *final-normed* hidden state at ``p`` (what vLLM's target forward returns and
hands to the drafter). Recursive steps (``K > 1``, as vLLM/SGLang run a single MTP module) feed the
MTP's own output ``g`` as ``h`` together with the token it just proposed (vLLM's ``qwen3_next_mtp.py``
returns the post-``norm`` hidden state and the next step consumes it). The norms are the main model
family's RMSNorm (``weight * x / rms(x)``); Qwen3-Next's own ``(1 + weight)`` norm belongs to an
architecture this engine does not load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model.attention import AttentionMetadata
from services.engine.model.kv_cache import KVCache
from services.engine.model.model import CausalLM, DecoderLayer, RMSNorm, linear, rms_norm, rope_tables
from services.engine.model.model_config import ModelConfig

MTP_PREFIX = "mtp."


class MTPHead(nn.Module):
    """The MTP module's own weights (filled by ``loader.load_mtp_head``); the main model's embedding, LM
    head and RoPE frequencies are used by reference, not copied and not counted as its parameters."""

    def __init__(self, config: ModelConfig, target: CausalLM, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, dtype, device)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, dtype, device)
        self.fc_weight = nn.Parameter(torch.empty(h, 2 * h, dtype=dtype, device=device), requires_grad=False)
        # Layer index 0 of the MTP's own one-layer KV cache, not of the main model's.
        self.layer = DecoderLayer(config, 0, dtype, device)
        self.norm = RMSNorm(h, eps, dtype, device)
        # A tuple is a plain attribute to nn.Module: the shared tensors stay the main model's.
        self._shared = (target.embed_tokens, target.lm_head, target.inv_freq, target.attention)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """``input_ids`` ``[T]`` (row ``p``: the token after ``p``), ``hidden`` ``[T, H]`` (the state at ``p``),
        ``positions`` ``[T]`` → the MTP's final-normed hidden states ``[T, H]`` (see the module docstring).
        Writes each row's K/V into layer 0 of ``kv_cache`` at ``meta.slot_mapping``."""
        embed_tokens, _lm_head, inv_freq, attention = self._shared
        e = F.embedding(input_ids, embed_tokens)
        e = rms_norm(e, self.pre_fc_norm_embedding.weight, self.pre_fc_norm_embedding.eps)
        h = rms_norm(hidden, self.pre_fc_norm_hidden.weight, self.pre_fc_norm_hidden.eps)
        x = linear(torch.cat((e, h), dim=-1), self.fc_weight)
        cos, signed_sin = rope_tables(positions, inv_freq, x.dtype)
        x = self.layer.forward(x, cos, signed_sin, meta, kv_cache, attention)
        return rms_norm(x, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, H]`` → float32 logits ``[N, vocab]`` through the main model's LM head."""
        return linear(hidden, self._shared[1]).float()
