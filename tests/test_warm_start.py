"""Held-out greedy evaluation (hexrl.data.heldout) and the supervised warm start (hexrl.train.warm_start)."""
import json

import pytest
import torch

from hexrl.data.datasets import make_arithmetic
from hexrl.data.heldout import greedy_accuracy, prompt_ids
from hexrl.data.tokenizer import CharTokenizer, load_tokenizer
from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.rewards import exact_match_reward
from hexrl.train import warm_start

TOK = CharTokenizer()


def naive_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The obvious reference: one sequence at a time, argmax, stop at eos."""
    ids, out = prompt_ids(tokenizer, prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if t == tokenizer.eos_id:
                break
            out.append(t)
    return tokenizer.decode(out)


def test_greedy_accuracy_matches_naive_loop_on_mixed_prompt_lengths():
    model = warm_start.build_model(warm_start.ModelShape(hidden=32, layers=2, intermediate=64), seed=0)
    model.init_weights(std=0.3, seed=1)  # spread-out logits: no argmax near-ties
    problems = make_arithmetic(10, seed=3, digits=(1, 2))  # prompt lengths 4, 5 and 6
    assert len({len(p.prompt) for p in problems}) > 1
    acc, completions = greedy_accuracy(model, TOK, problems, max_new_tokens=5, batch_size=3)
    expected = [naive_greedy(model, TOK, p.prompt, 5) for p in problems]
    assert completions == expected
    assert acc == sum(exact_match_reward(c, p.answer) for c, p in zip(expected, problems)) / len(problems)


class Oracle(torch.nn.Module):
    """Answers the `known` prompts correctly (then eos); otherwise emits '9' forever."""

    def __init__(self, known: dict[str, str]):
        super().__init__()
        self.known = {tuple(TOK.encode(q)): TOK.encode(a) + [TOK.eos_id] for q, a in known.items()}

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, TOK.vocab_size)
        for b, row in enumerate(ids.tolist()):
            for plen in range(1, len(row) + 1):
                if tuple(row[:plen]) in self.known:
                    target = self.known[tuple(row[:plen])]
                    nxt = target[min(len(row) - plen, len(target) - 1)]
                    break
            else:
                nxt = TOK.encode("9")[0]
            logits[b, -1, nxt] = 1.0
        return logits


def test_greedy_accuracy_scores_exact_match_and_stops_at_eos():
    problems = make_arithmetic(8, seed=1, digits=(1, 2))
    oracle = Oracle({p.prompt: p.answer for p in problems[::2]})
    acc, completions = greedy_accuracy(oracle, TOK, problems, max_new_tokens=4, batch_size=2)
    assert acc == 0.5
    assert completions[::2] == [p.answer for p in problems[::2]]  # cut before eos
    assert completions[1::2] == ["9999"] * 4  # no eos: runs to max_new_tokens


def test_greedy_accuracy_reports_every_bad_argument():
    with pytest.raises(ValueError, match=r"problems: empty.*max_new_tokens.*batch_size"):
        greedy_accuracy(Oracle({}), TOK, [], max_new_tokens=0, batch_size=0)


def test_sft_targets_are_answer_and_eos_only():
    problems = make_arithmetic(5, seed=0, digits=(1, 2))
    ids, tgt = warm_start.sft_batch(TOK, problems)
    for p, row_ids, row_tgt in zip(problems, ids.tolist(), tgt.tolist()):
        n = len(p.prompt)
        assert TOK.decode(row_ids[:n]) == p.prompt
        scored = [(i, t) for i, t in enumerate(row_tgt) if t != -100]
        assert [i for i, _ in scored] == list(range(n - 1, n + len(p.answer)))  # position t predicts t+1
        assert [t for _, t in scored] == TOK.encode(p.answer) + [TOK.eos_id]
        assert all(row_ids[i + 1] == t for i, t in scored)


def test_short_warm_start_learns_and_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "ws"
    args = ["--steps", "150", "--target-acc", "0", "--hidden", "32", "--layers", "2", "--intermediate", "64",
            "--digits", "1", "2", "--n-train", "600", "--n-heldout", "60", "--n-dev", "40", "--batch", "32",
            "--eval-every", "75", "--threads", "2"]
    info = warm_start.main([str(out), *args])
    saved = json.loads((out / "warm_start.json").read_text())
    assert saved["steps"] == 150 and saved["data_synthetic"]["n_heldout"] == 60
    assert isinstance(load_tokenizer(out), CharTokenizer)
    model = load_pretrained(out)
    task = warm_start.Task(digits=(1, 2), n_train=600, n_heldout=60, n_dev=40)
    _, _, heldout = task.split()
    acc, _ = greedy_accuracy(model, TOK, heldout, task.max_new_tokens(heldout))
    assert acc == pytest.approx(info["heldout_accuracy"])  # the checkpoint is the evaluated model
    # Loss on held-out answers, against the same architecture at its random init.
    batch = warm_start.sft_batch(TOK, heldout)
    random_init = warm_start.build_model(warm_start.ModelShape(hidden=32, layers=2, intermediate=64), seed=0)
    with torch.no_grad():
        trained_loss = warm_start.sft_loss(model, *batch).item()
        random_loss = warm_start.sft_loss(random_init, *batch).item()
    assert trained_loss < 0.5 * random_loss, (trained_loss, random_loss)


def test_progress_says_the_time_left():
    # 100 steps in 50 s of at most 1500: at most 700 s more; dev accuracy 0.10 -> 0.20 over the last 50 steps
    # reaches the 0.4 target in 100 more steps (50 s)
    assert warm_start.time_left(50.0, 100, 1500, 0.2, (50, 0.1), 0.4) == "left ~50s (at most 700s)"
    assert warm_start.time_left(50.0, 100, 1500, 0.2, (50, 0.3), 0.4) == "left at most 700s"  # no progress
    assert warm_start.time_left(50.0, 100, 1500, 0.2, None, 0.4) == "left at most 700s"  # the first evaluation
