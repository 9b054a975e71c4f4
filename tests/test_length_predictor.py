"""The length predictor: which groups of a batch run long, from each prompt's earlier groups, its
group's finished siblings, or (never seen) a hint or the median of every length so far.

    predictor = LengthPredictor()
    predictor.record(problem_id, lengths)                        # a completed group
    guess = predictor.predict(problem_id, finished=[...], group_size=8)   # siblings done, if any
    is_long([guess, ...], alpha=0.2)                             # the predicted longest 20%
"""
import json

import numpy as np
import pytest

from hexrl.control.length_predictor import LengthPredictor, LongTailWindow, is_long, outgrew, rank, recall
from hexrl.data.problems import length_hint

GROUP = 8


def structured_workload(seed: int, prompts: int = 256, epochs: int = 2):
    """Each prompt has a typical length (log-normal across prompts, sd 1); its samples spread around
    it (log sd 0.4): lengths [epoch][prompt][sample]."""
    rng = np.random.default_rng(seed)
    typical = np.log(800) + rng.standard_normal(prompts)
    return [np.rint(np.exp(typical[:, None] + 0.4 * rng.standard_normal((prompts, GROUP)))) for _ in range(epochs)]


def batch_recall(predicted, lengths, batch: int = 64) -> float:
    """recall@20% over consecutive batches of groups, a group's true length its samples' mean."""
    true = lengths.mean(axis=1)
    return float(np.mean([recall(predicted[s:s + batch], true[s:s + batch].tolist())
                          for s in range(0, len(true), batch)]))


def test_history_finds_the_long_tail_far_better_than_chance():
    first, second = structured_workload(seed=0)
    p = LengthPredictor()
    for i, lengths in enumerate(first):
        p.record(i, lengths)  # numpy numbers, as the run's arrays hold them
    predicted = [p.predict(i) for i in range(len(second))]
    assert batch_recall(predicted, second) > 0.6  # length-blind: 0.2


def test_finished_siblings_find_the_long_tail_of_prompts_never_seen():
    """One finished sample of each group (its shortest) already ranks groups; more rank them better."""
    _, lengths = structured_workload(seed=1)
    p = LengthPredictor()
    p.record("another prompt", [700, 900])  # the running median: the same guess for every prompt here

    def with_finished(k):
        return [p.predict(i, finished=sorted(g)[:k], group_size=GROUP) for i, g in enumerate(lengths.tolist())]

    assert batch_recall([p.predict(i) for i in range(len(lengths))], lengths) < 0.4  # all tie: chance
    one, half = batch_recall(with_finished(1), lengths), batch_recall(with_finished(GROUP // 2), lengths)
    assert one > 0.6 and half > one


def test_siblings_still_running_are_predicted_at_least_the_longest_finished():
    p = LengthPredictor()
    p.record("p", [100] * GROUP)  # its past says short
    # 2 of 4 finished at 500 and 900 tokens: the other two run at least 900 each
    assert p.predict("p", finished=[500, 900], group_size=4) >= (500 + 900 + 2 * 900) / 4
    # the whole group finished: its mean, whatever the past said
    assert p.predict("p", finished=[500, 900, 50, 50], group_size=4) == 375
    # siblings that finish late mark a group longer than ones that finish early
    assert p.predict("q", finished=[3000], group_size=4) > p.predict("q", finished=[100], group_size=4)
    # a prompt seen long whose group now finishes short: the samples still running are expected
    # shorter than its past says, too
    p.record("was long", [2000] * GROUP)
    quick = [100, 120, 130, 150]
    assert p.predict("was long", finished=quick, group_size=GROUP) < (sum(quick) + 4 * p.predict("was long")) / GROUP
    # mid-wave: samples that have already generated 5,000 tokens will be at least that long
    assert p.predict("p", generated=5000) == 5000
    assert p.predict("p", finished=[500], group_size=4, generated=5000) == (500 + 3 * 5000) / 4


def test_recent_epochs_count_more():
    grew, shrank = LengthPredictor(), LengthPredictor()
    grew.record("p", [100] * 4)
    grew.record("p", [1000] * 4)
    shrank.record("p", [1000] * 4)
    shrank.record("p", [100] * 4)
    assert grew.predict("p") > 550 > shrank.predict("p")


def test_a_prompt_never_seen_gets_the_median_or_its_hint():
    p = LengthPredictor()
    assert p.predict("new") == 0.0  # nothing recorded yet: every prompt ties
    for i in range(6):
        p.record(f"short{i}", [100] * 4)
    for i in range(3):
        p.record(f"mid{i}", [1000] * 4)
    p.record("long", [20000] * 4)
    # the median of the lengths recorded (within a histogram bin, 9%), not their mean (2,360)
    assert p.predict("new") == pytest.approx(100, rel=0.09)
    assert p.quantile(0.8) == pytest.approx(1000, rel=0.09)
    assert p.quantile(0.95) == pytest.approx(20000, rel=0.09)  # 4 of the 40 lengths
    # so a new prompt ranks between the prompts seen short and the one seen long
    assert rank([p.predict("short0"), p.predict("new"), p.predict("long")]) == [2, 1, 0]
    # a hint replaces the median as its prior
    assert p.predict("new", hint=5000) == 5000
    assert length_hint({"prompt": "1+1=", "answer": "2", "length_hint": 5000}) == 5000
    assert length_hint({"prompt": "1+1=", "answer": "2"}) is None


def test_memory_is_bounded_by_capacity_least_recently_recorded_forgotten_first():
    p = LengthPredictor(capacity=3)
    for i in range(3):
        p.record(i, [1000 * (i + 1)])
    p.record(0, [1000])  # prompt 0 is now the most recent
    p.record(3, [4000])
    assert list(p.prompts) == [2, 0, 3]  # prompt 1 forgotten
    assert p.predict(1) == p.predict("never seen")
    for i in range(4, 1000):
        p.record(i, [i])
    assert len(p.prompts) == 3 and len(p.seen.counts) == len(LengthPredictor().seen.counts)


def test_is_long_marks_the_predicted_longest_alpha():
    marked = is_long([5, 1, 9, 3, 7, 2, 8, 4, 6, 0], alpha=0.2)  # 2 of 10: the 9 and the 8
    assert [i for i, m in enumerate(marked) if m] == [2, 6]
    assert not any(is_long([5, 1, 9], alpha=0.0))  # alpha 0: no long-tail class at all
    assert is_long([1, 1, 1, 1, 1], alpha=0.4) == [True, True, False, False, False]  # ties: batch order
    assert recall([3, 2, 1, 0, 0], [9, 8, 0, 0, 0], alpha=0.4) == 1.0
    assert recall([0, 0, 0, 2, 3], [9, 8, 0, 0, 0], alpha=0.4) == 0.0


def test_a_group_outgrows_its_prediction_when_its_samples_pass_the_long_ones_of_the_window():
    predictor = LengthPredictor()
    predictor.record("short", [10] * 4)
    window = LongTailWindow(alpha=0.25, size=8)
    for guess, long in [(10, False)] * 5 + [(100, True)] * 2:  # the window's quota of 2 long groups is full
        window.add(guess, long)

    def grown(finished=(), running=()):
        return outgrew(predictor, window, "short", None, finished, running, group_size=2)

    assert not grown(running=[12, 8])  # a little past its history: still short of the long ones
    assert grown(running=[150, 8])  # one running sample is past them all: every running one is that long
    assert grown(finished=[160], running=[3])  # a finished sibling says the same
    assert not grown(finished=[160, 170])  # nothing left running: nothing to move


@pytest.mark.parametrize("call, message", [
    (lambda: is_long([1, 2], alpha=1.0), r"alpha must be in \[0, 1\), got 1.0"),
    (lambda: is_long([1, 2], alpha=-0.1), r"alpha must be in \[0, 1\), got -0.1"),
    (lambda: LengthPredictor().record("p7", [10, -3]),
     r"lengths of prompt 'p7' must be a non-negative number of tokens, got -3"),
    (lambda: LengthPredictor().record("p7", [float("nan")]), "lengths of prompt 'p7' must be a non-negative number"),
    (lambda: LengthPredictor().predict("p7", finished=[-1], group_size=4), "finished lengths must be a non-negative"),
    (lambda: LengthPredictor().predict("p7", finished=[1, 2], group_size=1), "group_size must be an int >= the 2"),
    (lambda: LengthPredictor().predict("p7", hint="long"), "hint must be a non-negative number of tokens"),
    (lambda: LengthPredictor().predict("p7", generated=-5), "generated must be a non-negative number of tokens"),
    (lambda: length_hint({"prompt": "x", "length_hint": "long"}),
     "'length_hint' must be a non-negative number of tokens, got 'long'"),
    (lambda: length_hint({"prompt": "x", "length_hint": True}), "'length_hint' must be a non-negative number"),
    (lambda: LengthPredictor(capacity=0), r"capacity must be an int >= 1 \(prompts remembered\), got 0"),
    (lambda: LengthPredictor(decay=0), r"decay must be in \(0, 1\], got 0"),
    (lambda: recall([1, 2], [1]), "predicted has 2 entries and actual 1"),
])
def test_bad_input_is_refused_with_the_field_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_length_recall_replays_a_runs_recorded_lengths(tmp_path, capsys):
    from tools.bench import length_recall

    # two steps of the same five prompts (groups of 2): "e" runs long both times, "a".."d" short
    rows = []
    for step, gid in ((1, 0), (2, 10)):
        ids = [p for p in "abcde" for _ in range(2)]
        groups = [gid + i // 2 for i in range(10)]
        lengths = [10, 12, 11, 13, 12, 12, 13, 11, 90, 70]
        rows.append({"step": step, "problem_ids": ids, "group_ids": groups, "lengths": lengths})
    (tmp_path / "lengths.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))  # any order
    steps = length_recall.run_steps(tmp_path)
    assert steps[0] == [("a", [10, 12]), ("b", [11, 13]), ("c", [12, 12]), ("d", [13, 11]), ("e", [90, 70])]
    table = length_recall.replay(steps)
    assert table["history (earlier steps)"] == 0.5  # step 1: nothing known yet (0); step 2: "e" found (1)
    assert table["history + siblings 50% finished"] == 1.0  # e's shortest sibling already outruns the rest
    assert 0.1 < table["length-blind (random order)"] < 0.3  # chance: alpha
    assert length_recall.replay(steps, seen_only=True)["history (earlier steps)"] == 1.0  # step 2 alone
    assert length_recall.main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 steps, 10 groups of 5 prompts (5 groups of a prompt seen at an earlier step), 20 samples" in out
    assert "| history (earlier steps) | 0.50 | 1.00 |" in out
    assert length_recall.main(["--run", str(tmp_path / "none")]) == 2
    assert "lengths.jsonl: no recorded steps" in capsys.readouterr().out
