"""``tools/train_demo_model.py`` end to end on a hand-made corpus: a run interrupted right after a checkpoint
and resumed with ``--resume`` ends with the same weights and the same loss history as one that was never
interrupted; a resume with other settings is refused with a message naming the difference; and the exported
folder is a checkpoint our engine loads and generates from.

The corpus stands in for the standard-library one (``build_corpus`` parses every stdlib module: minutes), and
everything else is the script's own code, including the tokenizer training, the export and the model card.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tools.train_demo_model as train_demo
from services.engine.llm import LLM, greedy

VOCAB_SIZE = 512
NUM_STEPS = 8
INTERRUPT_AT_STEP = 4
FLAGS = ["--steps", str(NUM_STEPS), "--batch-size", "2", "--seq-len", "32", "--vocab-size", str(VOCAB_SIZE),
         "--eval-every", "4", "--checkpoint-every", "2", "--threads", "1"]


def tiny_corpus() -> list[train_demo.Document]:
    """2,304 docstring-like sentences (about 160 KB): enough text for 512 BPE tokens and a held-out split."""
    subjects = ("The parser", "This function", "A bounded queue", "The socket", "Each worker thread",
                "The incremental encoder", "A weak reference", "The archive member")
    verbs = ("returns", "reads", "writes", "closes", "raises", "accepts", "compresses", "schedules")
    objects = ("the next item", "a sorted list of names", "the underlying file object", "an integer checksum",
               "the default value", "a mapping of headers")
    tails = ("if the file does not exist.", "when the buffer is empty.", "unless timeout is None.",
             "as a Unicode string.", "for every key in the dictionary.", "before the lock is released.")
    docs = [train_demo.Document(f"doc:{i}", f"{s} {v} {o} {t}")
            for i, (s, v, o, t) in enumerate(itertools.product(subjects, verbs, objects, tails))]
    docs.append(train_demo.Document("chat:json", "<|im_start|>user\nWhat is json?<|im_end|>\n"
                                                 "<|im_start|>assistant\nThe json module encodes data.<|im_end|>\n"))
    return docs


class Interrupted(Exception):
    """Stands in for a kill: raised right after the checkpoint of ``INTERRUPT_AT_STEP`` reached the disk."""


@pytest.fixture(autouse=True)
def hand_made_corpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(train_demo, "build_corpus", tiny_corpus)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the script sets it; this restores it afterwards
    threads = torch.get_num_threads()  # --threads 1 sets torch's process-wide count
    yield
    torch.set_num_threads(threads)


def run(work: Path, out: Path, *extra: str) -> None:
    train_demo.main(["--work-dir", str(work), "--out", str(out), *FLAGS, *extra])


def saved(work: Path) -> dict[str, object]:
    return torch.load(work / "state.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One uninterrupted run (``a``) and one killed after step 4's checkpoint, then resumed (``b``)."""
    base = tmp_path_factory.mktemp("train-demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_demo, "build_corpus", tiny_corpus)
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        threads = torch.get_num_threads()
        try:
            run(base / "a", base / "out-a")

            real_save = train_demo._save_state

            def save_then_die(path: Path, state: dict[str, object]) -> None:
                real_save(path, state)
                if state["step"] == INTERRUPT_AT_STEP:
                    raise Interrupted

            mp.setattr(train_demo, "_save_state", save_then_die)
            with pytest.raises(Interrupted):
                run(base / "b", base / "out-b")
            mp.setattr(train_demo, "_save_state", real_save)
            interrupted = saved(base / "b")
            assert interrupted["step"] == INTERRUPT_AT_STEP
            assert len(interrupted["history"]) == INTERRUPT_AT_STEP  # type: ignore[arg-type]
            assert not (base / "out-b").exists()
            run(base / "b", base / "out-b", "--resume")
        finally:
            torch.set_num_threads(threads)
    return {"a": base / "a", "out_a": base / "out-a", "b": base / "b", "out_b": base / "out-b"}


def test_the_corpus_stand_in_holds_out_at_least_one_evaluation_window(runs: dict[str, Path]) -> None:
    corpus = json.loads((runs["a"] / "metrics.json").read_text())["corpus"]
    assert corpus["val_documents"] >= 1 and corpus["train_documents"] > 10 * corpus["val_documents"]
    assert corpus["val_tokens"] >= 32 + 1  # one window: --seq-len inputs plus the next token


def test_a_run_resumed_after_an_interruption_ends_exactly_where_an_uninterrupted_run_ends(
        runs: dict[str, Path]) -> None:
    a, b = saved(runs["a"]), saved(runs["b"])
    assert a["step"] == b["step"] == NUM_STEPS
    assert [r["step"] for r in a["history"]] == list(range(1, NUM_STEPS + 1))  # type: ignore[union-attr]
    assert a["history"] == b["history"]  # every step's loss and lr, and the validation losses at 4 and 8
    assert [r["step"] for r in a["history"] if "val_loss" in r] == [4, 8]  # type: ignore[union-attr]
    weights_a = load_file(runs["out_a"] / "model.safetensors")
    weights_b = load_file(runs["out_b"] / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name, tensor in weights_a.items():
        assert torch.equal(tensor, weights_b[name]), name
    # The run did learn something: 8 steps of AdamW move the loss off its starting value ln(512) ≈ 6.24.
    assert a["history"][-1]["loss"] < a["history"][0]["loss"]  # type: ignore[index]


def test_resuming_with_another_learning_rate_is_refused_and_names_it(runs: dict[str, Path]) -> None:
    before = (runs["b"] / "state.pt").read_bytes()
    with pytest.raises(SystemExit, match=r"--resume: .*state\.pt was made with a different configuration: "
                                         r"lr 0\.002 \(this run: 0\.001\)\."):
        run(runs["b"], runs["out_b"], "--resume", "--lr", "0.001")
    assert (runs["b"] / "state.pt").read_bytes() == before


def test_resuming_with_another_vocabulary_size_is_refused_before_loading_any_weights(
        runs: dict[str, Path]) -> None:
    with pytest.raises(SystemExit, match=r"vocab_size 512 \(this run: 640\)"):
        run(runs["b"], runs["out_b"], "--resume", "--vocab-size", "640")


def test_a_run_killed_before_its_first_checkpoint_keeps_its_tokenizer_and_refuses_another_vocabulary_size(
        runs: dict[str, Path], tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "tokenizer.json").write_bytes((runs["b"] / "tokenizer.json").read_bytes())  # no state.pt yet
    with pytest.raises(SystemExit, match=r"tokenizer\.json has 512 tokens, not --vocab-size 640\."):
        run(work, tmp_path / "out", "--resume", "--vocab-size", "640")


def test_a_state_saved_before_shapes_were_recorded_is_checked_by_its_tensor_shapes(runs: dict[str, Path]) -> None:
    state = saved(runs["b"])
    del state["shape"]  # type: ignore[attr-defined]
    config = train_demo.TrainConfig(**state["train_config"])  # type: ignore[arg-type]
    assert train_demo.resume_mismatch(state, config, train_demo.Shape(vocab_size=VOCAB_SIZE)) == []  # type: ignore[arg-type]
    differences = train_demo.resume_mismatch(state, config, train_demo.Shape(vocab_size=640))  # type: ignore[arg-type]
    assert differences == ["model.embed_tokens.weight (512, 256) (this run: (640, 256))"]


def test_the_exported_folder_is_a_checkpoint_our_engine_serves(runs: dict[str, Path]) -> None:
    out = runs["out_b"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == VOCAB_SIZE
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    card = (out / "README.md").read_text()
    metrics = json.loads((runs["b"] / "metrics.json").read_text())
    assert f"**Validation loss {metrics['val_loss']:.3f} nats/token" in card
    assert f"{NUM_STEPS} steps x 2 sequences x 32 tokens = {NUM_STEPS * 2 * 32} tokens" in card
    llm = LLM(out, kv_capacity_tokens=256, torch_threads=1)
    [result] = llm.generate(["The parser returns"], greedy(4, ignore_eos=True))
    assert len(result.token_ids) == 4
    assert all(0 <= t < VOCAB_SIZE for t in result.token_ids)
