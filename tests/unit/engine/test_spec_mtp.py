"""``--spec mtp``: the checkpoint's own MTP module drafts, the target verifies, nothing changes but speed.

The engine-level tests reuse test_spec_decode's workload (staggered arrivals, prefix caching on, block
size 4 so rollbacks and the MTP's scratch blocks cross block boundaries) and compare every request's
tokens, text and finish reason with and without ``--spec mtp``. Two MTP modules cover the two regimes:
random ``mtp.*`` weights (drafts nearly always rejected: rollback every step) and a constructed "mirror"
module that predicts exactly what the model will (``tiny_checkpoint.mirror_mtp``: every draft accepted).
The MTP math itself is checked against a dense, cache-free implementation written out below.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from services.engine.__main__ import add_arguments, build_config
from services.engine.core.sampling_params import SamplingParams
from services.engine.errors import ModelLoadError, SpeculativeDecodingError
from services.engine.model.artifact import pack
from services.engine.model.loader import load_model
from services.engine.model.model_runner import RunnerSeq
from services.engine.outputs import RequestOutput
from services.engine.spec.draft_model import DraftTarget
from services.engine.spec.mtp_proposer import MTPProposer, MTPRows
from services.engine.spec.spec_decode import SpecConfig
from services.engine.tiny_checkpoint import mirror_mtp, write_tiny_checkpoint
from tests.unit.engine.model_helpers import make_runner, reversed_blocks
from tests.unit.engine.test_spec_decode import (
    ARRIVALS,
    BLOCK_SIZE,
    PROMPTS,
    greedy_params,
    make_core,
    run,
    summary,
)

_CHECKPOINTS: dict[tuple[str, str], Path] = {}


def checkpoint(factory: pytest.TempPathFactory, arch: str, kind: str) -> Path:
    """"random": the default tiny model plus a random MTP module; "mirror": one layer, MTP mirroring it."""
    key = (arch, kind)
    if key not in _CHECKPOINTS:
        path = factory.mktemp(f"{arch}-mtp-{kind}") / "ckpt"
        if kind == "mirror":
            mirror_mtp(write_tiny_checkpoint(path, arch=arch, num_layers=1, mtp_layers=1))
        else:
            write_tiny_checkpoint(path, arch=arch, mtp_layers=1)
        _CHECKPOINTS[key] = path
    return _CHECKPOINTS[key]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def target(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory, arch, "random")


@pytest.fixture(scope="module")
def baseline(target: Path) -> dict[str, list[RequestOutput]]:
    return run(make_core(target), PROMPTS, greedy_params(), ARRIVALS)


@pytest.fixture(scope="module")
def qwen3_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory, "qwen3", "random")


# ---- losslessness -------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_identical_with_and_without_mtp_drafts(
    k: int, target: Path, baseline: dict[str, list[RequestOutput]]
) -> None:
    core = make_core(target, SpecConfig(method="mtp", num_draft_tokens=k, lm_head_draft=True))
    got = run(core, PROMPTS, greedy_params(), ARRIVALS)  # checks the block invariants after every step
    for rid, outputs in baseline.items():
        assert summary(got[rid]) == summary(outputs), rid
    stats = core.snapshot(0.0).spec
    assert stats is not None and stats.method == "mtp" and stats.num_spec_tokens == k
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    assert sum(o[-1].num_draft_tokens for o in got.values()) == stats.num_draft_tokens
    pool = core.scheduler.block_pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_total_blocks
    # Follow-up turns hit the prefix cache (MTP K/V of cached blocks is reused, not recomputed): still exact.
    follow = [PROMPTS[i] + summary(got[f"r{i}"])[0][:-1] for i in range(3)]
    plain = run(make_core(target), follow, greedy_params()[:3], [0, 0, 0])
    again = run(core, follow, greedy_params()[:3], [0, 0, 0])
    assert all(o[-1].num_cached_tokens > len(PROMPTS[i]) for i, o in enumerate(again.values()))
    for rid in plain:
        assert summary(again[rid]) == summary(plain[rid])


@pytest.mark.parametrize("k", [1, 4])
def test_an_mtp_module_that_mirrors_the_model_has_every_draft_accepted(
    arch: str, k: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    mirror = checkpoint(tmp_path_factory, arch, "mirror")
    plain = run(make_core(mirror), PROMPTS, greedy_params(), ARRIVALS)
    core = make_core(mirror, SpecConfig(method="mtp", num_draft_tokens=k))
    got = run(core, PROMPTS, greedy_params(), ARRIVALS)
    for rid in plain:
        assert summary(got[rid]) == summary(plain[rid])
    stats = core.snapshot(0.0).spec
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # Each verification appends 1 + (drafts of that step) tokens: far fewer target steps than tokens.
    assert stats.mean_acceptance_length == 1 + stats.num_draft_tokens / stats.num_drafts


def test_sampled_requests_run_with_mtp_drafts(qwen3_mtp: Path) -> None:
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=i, ignore_eos=True) for i in range(3)]
    core = make_core(qwen3_mtp, SpecConfig(method="mtp", num_draft_tokens=3))
    out = run(core, PROMPTS[:3], params, [0, 0, 1])
    for outputs in out.values():
        tokens, _, reason, n = summary(outputs)
        assert reason == "length" and n == len(tokens) == 20
    stats = core.snapshot(0.0).spec
    assert stats is not None and sum(o[-1].num_draft_tokens for o in out.values()) == stats.num_draft_tokens > 0


# ---- the MTP math against a dense reference -------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
    return x * cos + rotated * sin


def dense_mtp(w: dict[str, torch.Tensor], cfg: dict[str, object], token_ids: list[int],
              hidden: torch.Tensor) -> torch.Tensor:
    """MTP output states ``[T, H]`` for rows ``p = 0 .. T-1`` (token after ``p``, hidden at ``p``), computed
    with plain causal attention over all rows at once: no cache, no paging."""
    eps, theta = float(cfg["rms_norm_eps"]), float(cfg["rope_theta"])  # type: ignore[arg-type]
    nh, nkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])  # type: ignore[call-overload]
    t = len(token_ids)
    e = w["model.embed_tokens.weight"][token_ids]
    x = torch.cat((_rms(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)), dim=-1) @ w["mtp.fc.weight"].T
    p = "mtp.layers.0."
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
    d = q.shape[-1] // nh
    q, k, v = q.view(t, nh, d), k.view(t, nkv, d), v.view(t, nkv, d)
    if p + "self_attn.q_norm.weight" in w:
        q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
    positions = torch.arange(t)
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * d)
    x = x + attn @ w[p + "self_attn.o_proj.weight"].T
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"].T
    return _rms(x, w["mtp.norm.weight"], eps)


def test_mtp_drafts_and_their_distributions_match_a_dense_reference(arch: str, target: Path) -> None:
    """Two requests batched; the first one's rows written over two proposer calls (the cache is read back
    across them); three drafts each, sampled at temperature 1 so the proposer hands back its full
    distributions ``q``, compared with softmax of the dense reference's logits (the recursion fed with
    the drafts the proposer drew)."""
    w = load_file(str(target / "model.safetensors"))
    cfg = json.loads((target / "config.json").read_text())
    model, config = load_model(target)
    runner = make_runner(model, config)
    proposer = MTPProposer(target, target=model, target_config=config, num_draft_tokens=3, num_target_blocks=64,
                           block_size=BLOCK_SIZE, max_concurrency=2, kv_dtype="auto", device=torch.device("cpu"))
    seqs = {"a": [5, 17, 300, 42, 99, 7, 8, 200, 201, 11, 12], "b": [9, 10, 11, 12, 9, 10, 11, 400]}
    tables = {"a": reversed_blocks(8, stride=2), "b": reversed_blocks(8, stride=2, first=1)}
    hidden = {}
    for rid, ids in seqs.items():  # target hidden states at positions 0 .. n-2 (the last token: no K/V yet)
        _, h = runner.run_with_hidden([RunnerSeq(token_ids=ids[:-1], start_pos=0, block_table=tables[rid],
                                                 needs_logits=True)])
        hidden[rid] = h
    split = 6
    assert proposer.propose([MTPRows("a", 0, seqs["a"][1 : split + 1], hidden["a"][:split], tables["a"])], {}) == {}
    params = SamplingParams(temperature=1.0, max_tokens=8)
    gens = {rid: torch.Generator().manual_seed(i) for i, rid in enumerate(seqs)}
    proposals = proposer.propose(
        [MTPRows("a", split, seqs["a"][split + 1 :], hidden["a"][split:], tables["a"]),
         MTPRows("b", 0, seqs["b"][1:], hidden["b"], tables["b"])],
        {rid: DraftTarget(rid, ids, 3, params, gens[rid]) for rid, ids in seqs.items()},
    )
    lm_head = w["lm_head.weight"]
    for rid, ids in seqs.items():
        proposal = proposals[rid]
        assert len(proposal.token_ids) == 3 and proposal.probs is not None
        tokens, states = list(ids[1:]), hidden[rid]
        for step, draft in enumerate(proposal.token_ids):
            out = dense_mtp(w, cfg, tokens, states)
            expected = (out[-1] @ lm_head.T).softmax(-1)
            torch.testing.assert_close(proposal.probs[step], expected, atol=2e-5, rtol=1e-4)
            tokens.append(draft)  # the next row: the token just drafted, the MTP's own output state
            states = torch.cat((states, out[-1:]))


# ---- checkpoints, loading, configuration -----------------------------------------------------------------


def test_an_mtp_module_leaves_the_tiny_models_own_weights_unchanged(tmp_path: Path) -> None:
    plain = load_file(str(write_tiny_checkpoint(tmp_path / "plain", arch="llama") / "model.safetensors"))
    with_mtp = write_tiny_checkpoint(tmp_path / "mtp", arch="llama", mtp_layers=1)
    tensors = load_file(str(with_mtp / "model.safetensors"))
    assert {n for n in tensors if not n.startswith("mtp.")} == set(plain)
    assert all(torch.equal(tensors[n], plain[n]) for n in plain)
    assert json.loads((with_mtp / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model, config = load_model(with_mtp)  # the plain loader ignores mtp.*
    assert config.num_mtp_layers == 1 and not any("mtp" in n for n, _ in model.named_parameters())


def test_runbook_flags_start_an_engine_on_an_mtp_checkpoint(qwen3_mtp: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(qwen3_mtp), "--data-dir", str(tmp_path), "--spec", "mtp", "--draft-tokens", "4",
                              "--lm-head-draft"])
    engine, _, _ = build_config(args)
    assert engine.spec == SpecConfig(method="mtp", num_draft_tokens=4, lm_head_draft=True)
    core = make_core(qwen3_mtp, engine.spec)
    assert core.mtp is not None and "speculative decoding mtp, 4 draft tokens" in core.describe()
    assert core.mtp.num_params > 0


def test_a_ninfer_artifact_carries_the_mtp_module(qwen3_mtp: Path, tmp_path: Path) -> None:
    artifact = pack(qwen3_mtp, tmp_path / "m.ninfer")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine, _, _ = build_config(parser.parse_args([str(artifact), "--data-dir", str(tmp_path), "--spec", "mtp"]))
    core = make_core(engine.model_path, engine.spec)
    assert core.mtp is not None


def test_spec_mtp_without_mtp_weights_is_refused_at_start(tmp_path: Path) -> None:
    plain = write_tiny_checkpoint(tmp_path / "plain", arch="qwen3", num_layers=1)
    with pytest.raises(SpeculativeDecodingError, match=r"has no MTP weights \(mtp\.\* .*\); use --spec ngram"):
        make_core(plain, SpecConfig(method="mtp"))


def test_an_incomplete_mtp_module_fails_naming_the_missing_tensor(qwen3_mtp: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in qwen3_mtp.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["mtp.norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'mtp\.norm\.weight'"):
        make_core(broken, SpecConfig(method="mtp"))


def test_the_whole_runbook_command_line_parses_with_kv_capacity_auto(qwen3_mtp: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [str(qwen3_mtp), "--host", "0.0.0.0", "--port", "8006", "--model-id", "qwen3.8-27b",
            "--max-context", "256", "--kv-dtype", "fp8", "--max-concurrency", "8", "--max-pending-requests", "64",
            "--spec", "mtp", "--draft-tokens", "4", "--lm-head-draft", "--preserve-thinking",
            "--electricity-rate", "0.125", "--metrics-state", str(tmp_path / "metrics-state.json"),
            "--kv-capacity", "auto", "--data-dir", str(tmp_path)]
    engine, serve, _ = build_config(parser.parse_args(argv))
    assert engine.kv_capacity_tokens is None and engine.kv_dtype == "fp8" and engine.spec.method == "mtp"
    assert serve.port == 8006
    with pytest.raises(SystemExit):
        parser.parse_args([str(qwen3_mtp), "--kv-capacity", "lots"])


@pytest.mark.parametrize("layout", ["deepseek-v3", "deepseek-under-mtp"])
def test_deepseek_style_mtp_names_load_the_same_module(qwen3_mtp: Path, tmp_path: Path, layout: str) -> None:
    """The same MTP weights stored under DeepSeek-V3's names (enorm, hnorm, eh_proj, shared_head.norm and a
    block, as the layer after the last, or under mtp.) give exactly the drafts of the Qwen3-Next names."""
    renamed = tmp_path / layout
    renamed.mkdir()
    for f in qwen3_mtp.iterdir():
        (renamed / f.name).write_bytes(f.read_bytes())
    config = json.loads((renamed / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}." if layout == "deepseek-v3" else "mtp."
    if layout == "deepseek-v3":  # DeepSeek's own key for the number of MTP modules
        config["num_nextn_predict_layers"] = config.pop("mtp_num_hidden_layers", 1)
        (renamed / "config.json").write_text(json.dumps(config))
    names = {"pre_fc_norm_embedding.weight": "enorm.weight", "pre_fc_norm_hidden.weight": "hnorm.weight",
             "fc.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
    tensors = load_file(str(renamed / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("mtp."):
            leaf = name.removeprefix("mtp.")
            name = prefix + (names[leaf] if leaf in names else leaf.removeprefix("layers.0."))
        out[name] = tensor
    head = tensors["lm_head.weight"] if "lm_head.weight" in tensors else tensors["model.embed_tokens.weight"]
    out[prefix + "shared_head.head.weight"] = head.clone()  # DeepSeek stores a copy of the head: not read
    assert not any(n.startswith("mtp.") for n in out) or layout == "deepseek-under-mtp"
    save_file(out, str(renamed / "model.safetensors"))

    spec = SpecConfig(method="mtp", num_draft_tokens=3)
    original, copy = make_core(qwen3_mtp, spec), make_core(renamed, spec)
    want = run(original, PROMPTS, greedy_params(), ARRIVALS)
    got = run(copy, PROMPTS, greedy_params(), ARRIVALS)
    assert {rid: summary(o) for rid, o in got.items()} == {rid: summary(o) for rid, o in want.items()}
    assert copy.snapshot(0.0).spec == original.snapshot(0.0).spec  # the same drafts, accepted alike
    assert original.snapshot(0.0).spec.num_draft_tokens > 0  # type: ignore[union-attr]
