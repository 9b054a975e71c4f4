"""The staleness study's per-step metrics, each against an independent reference:
the trained tokens' staleness histogram (by hand; it adds up to the trained token count), the
importance weights' spread and the cap's share (a float64 forward per sequence), the policy
change between versions (float64 KL of two separately loaded models; 0 for the same weights),
and the share of groups filtered for equal rewards (a replay buffer's own counts)."""
import argparse
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_train_parallel import CONFIG, make_batch, reference_step, seq_logprobs

from hexrl.control.buffer import ReplayBuffer
from hexrl.control.metrics import equal_reward_share
from hexrl.data.heldout import prompt_ids
from hexrl.data.problems import Problem
from hexrl.data.tokenizer import load_tokenizer
from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.schema import load_job
from hexrl.train import TrainConfig, Trainer
from hexrl.train.checkpoint import gather_stage
from hexrl.train.importance import log_w_counts, w_quantile
from hexrl.train.packing import plan_batch
from hexrl.train.probe import PolicyProbe, policy_kl, probe_batch
from hexrl.trajectory import Trajectory

SINGLE = {"dp": 1, "stages": [{"tp": 1, "layers": [0, 2]}]}


def stale_batch() -> list[Trajectory]:
    """make_batch with versions 0-3 per token (some trajectories mixing two versions) and behaviour
    log-probs near the model's (so w spreads around 1 with a tail past the cap)."""
    rng = random.Random(3)
    out = make_batch()
    for t in out:
        v = rng.randrange(4)
        cut = rng.randrange(len(t.completion_ids) + 1)
        t.versions = [max(v - 1, 0)] * cut + [v] * (len(t.completion_ids) - cut)
    return out


def test_token_staleness_histogram_counts_every_trained_token_by_lag(tmp_path):
    trainer = Trainer(make_tiny_model(tmp_path / "m", layers=2, tie=False), SINGLE, TrainConfig(lr=1e-3))
    trainer.version = 5
    batch = stale_batch()
    m = trainer.step(batch)
    by_hand: dict[str, int] = {}
    for t in batch:
        if t.group_id == 0:  # all-equal rewards: filtered, not trained
            continue
        for v in t.versions:
            by_hand[str(5 - v)] = by_hand.get(str(5 - v), 0) + 1
    assert m["token_staleness_hist"] == by_hand
    assert sum(m["token_staleness_hist"].values()) == m["tokens"]
    assert len(by_hand) >= 3  # the batch really mixes lags
    assert plan_batch([], 1, 1, 64).summary.token_staleness(3) == {}  # an empty batch


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_a_lag_scaled_step_matches_the_reference(tmp_path, scale):
    """rl.lr_lag_scale: a token k versions old takes 1 / (1 + scale * k) of its step; the trainer's
    update equals the single-process reference's, and differs from the unscaled one."""
    path = make_tiny_model(tmp_path / "m", layers=2, tie=False)
    cfg = TrainConfig(**{**CONFIG, "lr_lag_scale": scale})
    trainer = Trainer(path, SINGLE, cfg)
    trainer.version = 5
    m = trainer.step(stale_batch())
    loss, _, _, weights = reference_step(path, stale_batch(), cfg, version=5)
    assert m["loss"] == pytest.approx(loss, abs=2e-5)
    got = gather_stage(trainer.model, trainer.grid)
    for name, w in weights.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    if scale:
        _, _, _, plain = reference_step(path, stale_batch(), TrainConfig(**CONFIG), version=5)
        assert max((plain[k] - w).abs().max().item() for k, w in weights.items()) > 1e-4


def test_importance_weight_spread_and_cap_share_match_a_float64_forward(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=2, tie=False)
    batch = make_batch()
    model = load_pretrained(path).double()
    with torch.no_grad():  # behaviour log-probs near the model's, a few far below (w past the cap)
        rng = np.random.default_rng(0)
        for t in batch:
            lp = seq_logprobs(model, t).numpy()
            t.logprobs = (lp + rng.normal(0, 0.3, len(lp)) - (rng.random(len(lp)) < 0.1) * 2.5).tolist()
    trainer = Trainer(path, SINGLE, TrainConfig(lr=1e-3, behav_cap=5.0, ppo_minibatches=2))
    m = trainer.step(batch)
    with torch.no_grad():
        w = torch.cat([(seq_logprobs(model, t) - torch.tensor(t.logprobs, dtype=torch.float64)).exp()
                       for t in batch if t.group_id != 0]).numpy()
    assert len(w) == m["tokens"]
    assert m["capped_frac"] == pytest.approx(np.mean(w > 5.0), abs=1e-12) and m["capped_frac"] > 0
    assert m["mean_w"] == pytest.approx(w.mean(), rel=1e-5)
    assert m["w_std"] == pytest.approx(w.std(), rel=1e-4) and m["w_std"] > 0.2
    for q in ("05", "50", "95"):  # the bin's centre: within half a bin (0.5%) of the exact quantile
        exact = np.quantile(w, int(q) / 100, method="inverted_cdf")
        assert abs(np.log(m[f"w_p{q}"]) - np.log(exact)) <= 0.005 + 1e-9, (q, m[f"w_p{q}"], exact)




@pytest.mark.parametrize("decoupled", [True, False])
def test_logprob_mismatch_is_measured_over_lag0_tokens_only(tmp_path, decoupled):
    """The log-prob mismatch is |behaviour - proximal| over the tokens the step's own starting weights generated. Lag-0
    behaviour log-probs are the model's (float64) plus a known offset; stale tokens get a large one that
    must not count. Without a proximal pass (naive PPO) the first mini-batch's θ log-probs stand in."""
    path = make_tiny_model(tmp_path / "m", layers=2, tie=False)
    model = load_pretrained(path).double()
    batch, rng, want = make_batch(), np.random.default_rng(1), []
    for k, t in enumerate(batch):
        with torch.no_grad():
            lp = seq_logprobs(model, t).numpy()
        t.versions = [7 if (k + j) % 3 else 6 for j in range(len(lp))]  # trainer at 7: lag 0, else lag 1
        off = rng.uniform(1e-3, 0.3, len(lp)) * rng.choice([-1, 1], len(lp))
        t.logprobs = [x + (o if v == 7 else 2.0) for x, o, v in zip(lp, off, t.versions)]
        if t.group_id != 0:  # group 0: equal rewards, filtered before the forward
            want += [abs(o) for o, v in zip(off, t.versions) if v == 7]
    trainer = Trainer(path, SINGLE, TrainConfig(lr=1e-3, decoupled=decoupled, ppo_minibatches=1 if decoupled else 2))
    trainer.version = 7
    m = trainer.step(batch)
    if not decoupled:  # only the first mini-batch's tokens are measured
        assert 0 < m["logprob_mismatch_tokens"] < len(want)
        return
    assert m["logprob_mismatch_tokens"] == len(want) > 10
    assert m["logprob_mismatch_mean"] == pytest.approx(np.mean(want), abs=1e-5)
    exact = np.quantile(want, 0.99, method="inverted_cdf")
    assert exact <= m["logprob_mismatch_p99"] <= exact * 10 ** 0.05 + 1e-9  # the bin's upper edge


def test_logprob_mismatch_of_a_fresh_batch_is_zero_on_cpu(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=2, tie=False)
    model = load_pretrained(path)
    batch = make_batch()
    with torch.no_grad():
        for t in batch:
            t.logprobs = seq_logprobs(model, t).tolist()
    m = Trainer(path, SINGLE, TrainConfig(lr=1e-3)).step(batch)
    assert m["logprob_mismatch_tokens"] == m["tokens"] and m["logprob_mismatch_mean"] < 1e-5
    assert m["logprob_mismatch_p99"] <= 1e-5


def test_proximal_per_minibatch_is_the_weights_each_minibatch_starts_from(tmp_path):
    """rl.proximal = "minibatch", the study's ablation: each mini-batch's proximal log-probs come from
    the weights the step's earlier mini-batches left, so its ratio starts at 1 and nothing is clipped;
    the weights match a plain reference that recomputes them, and differ from AReaL's per-step proximal."""
    path = make_tiny_model(tmp_path / "m", layers=2, tie=False)
    cfg = dict(CONFIG, lr=3e-2)  # a large step: the per-step proximal clips in the second mini-batch
    out = {}
    for mode in ("step", "minibatch"):
        trainer = Trainer(path, SINGLE, TrainConfig(proximal=mode, **cfg))
        out[mode] = trainer.step(make_batch()), gather_stage(trainer.model, trainer.grid)
    assert out["minibatch"][0]["clip_frac"] == 0 < out["step"][0]["clip_frac"]
    *_, ref = reference_step(path, make_batch(), TrainConfig(proximal="minibatch", **cfg))
    for name, w in ref.items():  # 1e-4: 0.3% of one Adam step at this lr
        torch.testing.assert_close(out["minibatch"][1][name], w, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    gap = max((out["step"][1][k] - w).abs().max().item() for k, w in ref.items())
    assert gap > 1e-2, gap  # a third of a step (lr 3e-2): the per-step proximal moved the weights elsewhere


def test_proximal_is_a_checked_job_field():
    job = {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 64}},
           "cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}]}, "rl": {"proximal": "minibatch"}}
    assert load_job(job, check_paths=False).rl.proximal == "minibatch"
    assert load_job({**job, "rl": {}}, check_paths=False).rl.proximal == "step"
    with pytest.raises(ValueError, match="proximal"):
        load_job({**job, "rl": {"proximal": "behaviour"}}, check_paths=False)
    assert "train.proximal" in TrainConfig(proximal="x").problems()[0]


def test_w_quantile_open_bins_and_no_tokens():
    assert w_quantile(log_w_counts(torch.ones(7)), 0.95) == 1.0  # w = 1 sits in the bin centred on 1
    assert w_quantile(log_w_counts(torch.tensor([1.0, 100.0])), 0.95) == float("inf")
    assert w_quantile(log_w_counts(torch.tensor([1e-3, 1.0])), 0.05) == pytest.approx(np.exp(-3.005))
    assert w_quantile(torch.zeros(log_w_counts(torch.ones(1)).shape), 0.5) is None


def reference_kl(before, after, tokenizer, problems) -> float:
    """Mean over answer positions of KL(before ‖ after), float64, one unpacked sequence at a time."""
    terms = []
    for p in problems:
        prompt = prompt_ids(tokenizer, p.prompt)
        ids = torch.tensor(prompt + tokenizer.encode(p.answer) + [tokenizer.eos_id])
        rows = slice(len(prompt) - 1, len(ids) - 1)  # the positions that predict an answer token
        a, b = (torch.log_softmax(m(ids[None, :-1])[0].double(), -1)[rows] for m in (before, after))
        terms.append((a.exp() * (a - b)).sum(-1))
    return float(torch.cat(terms).mean())


def test_policy_kl_probe_is_zero_for_one_version_and_matches_float64_after_a_step(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=2, tie=False, tokenizer="char")
    tok = load_tokenizer(path)
    problems = [Problem(f"{a}+{b}", str(a + b), i, kind="synthetic")
                for i, (a, b) in enumerate([(12, 34), (5, 77), (40, 40), (99, 1), (3, 8)])]
    trainer = Trainer(path, SINGLE, TrainConfig(lr=3e-2, ppo_minibatches=1))
    probe = PolicyProbe(probe_batch(problems, tok, 4))  # the first 4 problems
    assert probe.measure(trainer) is None  # nothing to compare with yet
    assert probe.measure(trainer) == 0.0  # the same weights: exactly 0
    batch = make_batch()
    for t in batch:  # ids inside the char vocabulary
        t.prompt_ids = [3 + x % 20 for x in t.prompt_ids]
        t.completion_ids = [3 + x % 20 for x in t.completion_ids]
    trainer.step(batch)
    kl = probe.measure(trainer)
    trainer.export_hf(tmp_path / "after")
    with torch.no_grad():
        ref = reference_kl(load_pretrained(path).double(), load_pretrained(tmp_path / "after").double(), tok,
                           problems[:4])
        back = reference_kl(load_pretrained(tmp_path / "after").double(), load_pretrained(path).double(), tok,
                            problems[:4])
    assert kl > 1e-3 and kl == pytest.approx(ref, rel=1e-4)
    assert abs(back - ref) > 1e-3 * ref  # the direction matters at this step size: KL(before ‖ after) it is


def test_policy_kl_against_torch_kl_div():
    g = torch.Generator().manual_seed(0)
    a, b = (torch.log_softmax(torch.randn(6, 11, generator=g) * 2, -1) for _ in range(2))
    a[0, 3] = -torch.inf  # a token the first policy never samples: 0 · log 0 = 0
    a[0] = torch.log_softmax(a[0], -1)
    want = F.kl_div(b.double(), a.double(), log_target=True, reduction="none").nan_to_num(0.0).sum(-1).mean()
    assert policy_kl(a, b) == pytest.approx(float(want), rel=1e-12)
    assert policy_kl(a, a) == 0.0


def test_equal_reward_share_from_the_buffer_counts():
    buf = ReplayBuffer()
    before = buf.accounting()
    for gid, rewards in enumerate([(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (1.0, 0.0)]):
        buf.expect(gid, 2)
        for r in rewards:
            buf.add(Trajectory(gid, [1], [4], [-1.0], [0], reward=r))
    buf.expect(9, 2)
    buf.add(Trajectory(9, [1], [4], [-1.0], [0], reward=1.0))  # pending: not completed, not counted
    assert equal_reward_share(before, buf.accounting()) == 0.5
    assert equal_reward_share(buf.accounting(), buf.accounting()) is None


def test_policy_kl_probe_is_a_job_field(tmp_path):
    job = {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 64}},
           "cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}]}, "rl": {"policy_kl_probe": 32}}
    assert load_job(job, check_paths=False).rl.policy_kl_probe == 32
    assert load_job({**job, "rl": {}}, check_paths=False).rl.policy_kl_probe == 0
    with pytest.raises(ValueError, match="policy_kl_probe"):
        load_job({**job, "rl": {"policy_kl_probe": -1}}, check_paths=False)


def fake_run(root: Path, name: str, accs: list[float], lags: list[dict], wall_per_step: float) -> Path:
    """A finished run directory as the study reads it: metrics.jsonl (one line per step) and eval.jsonl
    (every 2 steps)."""
    run = root / name
    run.mkdir(parents=True)
    rows = [{"step": i + 1, "wall_s": wall_per_step * (i + 1), "trajectories_trained": 10 * (i + 1),
             "trajectories_accepted": 10 * (i + 1), "filtered_reasons": {"equal_rewards": 30 * (i + 1)},
             "wait_s": 0.5 * wall_per_step, "train_s": 0.1, "token_staleness_hist": h, "policy_kl": 1e-3,
             "w_std": 0.1, "w_p05": 0.9, "w_p95": 1.1, "capped_frac": 0.0, "clip_frac": 0.01, "grad_norm": 1.0,
             "equal_reward_share": 0.75} for i, h in enumerate(lags)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": 2 * k, "heldout_accuracy": a, "wall_s": wall_per_step * 2 * k} for k, a in enumerate(accs)]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return run


def test_staleness_study_aggregates_lags_gaps_and_the_targets(tmp_path):
    from tools.experiments import staleness_study as st

    sync = st.run_stats(fake_run(tmp_path, "s", [0.4, 0.7, 0.85, 0.9], [{"0": 10}] * 6, 2.0))
    stale = st.run_stats(fake_run(tmp_path, "a", [0.4, 0.6, 0.81, 0.89], [{"3": 6, "4": 2}, {"0": 2, "1": 6}] * 3,
                                  1.0))
    assert stale["mean_lag"] == pytest.approx((3 * 18 + 4 * 6 + 6 * 3) / 48)  # tokens, not steps, are averaged
    assert stale["lag3"] == pytest.approx(18 / 48) and stale["lag2"] == 0
    assert stale["average"] == pytest.approx((0.6 + 0.81 + 0.89) / 3)  # the evaluations after step 0
    assert sync["wall_target"] == 8.0 and stale["wall_target"] == 4.0  # the first evaluation at >= 0.8
    assert sync["equal_share"] == pytest.approx(0.75)
    rows = {r["name"]: r for r in (st.aggregate(st.name_of(1e-4, "0", True), [sync]),
                                   st.aggregate(st.name_of(1e-4, "4", True), [stale]))}
    text = "\n".join(st.targets(rows, [1e-4]))
    assert "gap +1.0 points (within 2)" in text  # 0.90 - 0.89 at the last step
    assert "gap +5.0 points (NOT within 2)" in text  # 0.817 - 0.767 on average
    assert "4 vs 8, 0.50x (meets <= 0.7x)" in text


def test_the_smoothed_time_to_80_percent_is_not_one_lucky_evaluation():
    from tools.experiments import staleness_study as st

    accs = [0.70, 0.76, 0.81, 0.76, 0.78, 0.79, 0.80, 0.82, 0.81, 0.83]  # every 5 steps; a spike at step 10
    evals = [{"step": 5 * i, "heldout_accuracy": a, "wall_s": float(i)} for i, a in enumerate(accs)]
    assert st.smooth_hit(evals, half=0)["step"] == 10  # no smoothing: the first evaluation at >= 0.8
    assert st.smooth_hit(evals, half=5)["step"] == 30  # (0.79 + 0.80 + 0.82) / 3 >= 0.8; at 25: 0.790
    assert st.smooth_hit(evals[:6], half=5) is None



def test_causes_report_sets_each_cause_against_its_own_eta0(tmp_path):
    """--causes --report: one row per cause (and per eta of the version-mix cause), from finished runs only;
    the batch cause doubles the batch and halves the steps (equal trained samples)."""
    from tools.experiments import staleness_study as st

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "warm_start.json").write_text(json.dumps(
        {"data_synthetic": {"task": "arithmetic"}, "max_new_tokens": 8, "heldout_accuracy": 0.4}))
    lags = [{"4": 10}] * 6
    sync = ([0.4, 0.7, 0.85, 0.9], 2.0)
    for cause, etas in (("base", {"1": ([0.4, 0.7, 0.85, 0.88], 1.5), "4": ([0.4, 0.6, 0.81, 0.89], 1.0)}),
                        ("clip0.1", {"4": ([0.4, 0.7, 0.75, 0.85], 1.0)})):
        for eta, (accs, wall) in {"0": sync, **etas}.items():
            run = fake_run(tmp_path / cause, f"{st.name_of(1e-4, eta, True)}-s0", accs, lags, wall)
            (run / "final").mkdir()
            (run / "final" / "config.json").write_text("{}")
    st.main([str(tmp_path), "--causes", "--report", "--seeds", "1", "--configs", "1e-4:0:decoupled"])
    rows = [x for x in (tmp_path / "causes.md").read_text().splitlines() if x.startswith("| ") and "---" not in x]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| base, eta=1", "| base, eta=4", "| clip0.1, eta=4"]
    # eta=1: 0.90 - 0.88 at the last step; 80% at step 4 in 6 s against 8 s
    assert "| 0.900 / 0.817 | 0.880 / 0.810 | +2.0 | +0.7 | 0.75x / not reached |" in rows[1]
    assert "| +1.0 | +5.0 | 0.50x / not reached |" in rows[2]
    assert "| +5.0 | +5.0 | 0.75x / not reached |" in rows[3]  # clip0.1: its eta=4 reaches 80% at step 6 (6 s)
    args = st.cause_args(argparse.Namespace(batch=64, steps=400, eval_every=10, clip=0.2), st.CAUSES["batch128"][0])
    assert (args.batch, args.steps, args.eval_every, args.clip) == (128, 200, 5, 0.2)
    assert st.cause_args(args, st.CAUSES["clip0.1"][0]).clip == 0.1


class Zeros(dict):
    """A counters/metrics dict whose missing keys read 0."""

    def __missing__(self, key):
        return 0


def test_untimed_work_runs_before_the_rollout_hears_of_the_new_version(monkeypatch, tmp_path):
    """The KL probe and the held-out evaluation are kept out of wall_s. Were they run after the new
    version is published, a synchronous run's rollout would generate its next batch in that uncounted
    time, which flatters eta=0's wall time against any eta > 0. So they run first."""
    from types import SimpleNamespace as NS

    import hexrl.train.trainer_rank as worker

    events = []
    monkeypatch.setattr(worker, "share_batch", lambda batch, *a: batch)
    monkeypatch.setattr(worker, "sync_weights", lambda *a: events.append("sync") or 0.0)
    traj = Trajectory(group_id=0, prompt_ids=[1], completion_ids=[2], logprobs=[-1.0], versions=[0], reward=1.0)
    counters = Zeros(filtered={}, dropped={}, rejected_reasons={}, replica_tokens={})
    controller = NS(counters=lambda: counters, next_batch=lambda: [NS(group_id=0, trajectories=[traj])],
                    choose_eta=lambda *a: 4,
                    publish_version=lambda v: events.append("publish"), wait_delivered=lambda v: None)
    trainer = NS(version=0, grid=NS(trainer_group=None), save=lambda *a: None)
    trainer.step = lambda batch: setattr(trainer, "version", 1) or Zeros(token_staleness_hist={})
    evaluator = NS(seconds=0.0, wall=lambda: 0.0, maybe=lambda t, step: events.append("eval"))
    probe = NS(measure=lambda t: events.append("probe"))
    ctx = NS(plan=NS(job=NS(rl=NS(steps=10, checkpoint_every=0))), run_dir=tmp_path, controller_rank=0, device="cpu")
    metrics = NS(log=lambda m: None, log_lengths=lambda *a: None)
    worker.run_step(ctx, trainer, controller, metrics, evaluator, 0, torch.float32, probe)
    assert events == ["probe", "eval", "publish", "sync"]

@pytest.mark.gpu
def test_gpu_log_w_counts_match_the_cpu_counts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = torch.exp(torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 0.3)
    w[:10] = torch.tensor([0.0, 1e-3, 1e3, 1.0, 5.0, 5.0001, 0.5, 2.0, 1.005, 0.995])  # open bins and near edges
    got = log_w_counts(w.cuda())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), log_w_counts(w.double()), rtol=0, atol=0)


def test_paired_gaps_match_seeds_and_carry_a_t_interval(tmp_path):
    """The study's claims rest on per-seed differences, so the interval is a t-interval over those
    differences (seeds matched by number, not by position), and a seed without its pair counts for nothing."""
    from tools.experiments import staleness_study as st

    def stat(seed, final, wall, traj=100.0):
        return {"seed": seed, "final": final, "average": final - 0.1, "wall_target": wall, "wall_target_smooth": None,
                "traj_per_s": traj}

    base = [stat(0, 0.90, 100), stat(1, 0.92, 100), stat(2, 0.88, 100), stat(3, 0.91, 100)]
    other = [stat(3, 0.88, 60, 180), stat(1, 0.90, 70, 190), stat(0, 0.89, 50, 200), stat(2, 0.88, None, 170),
             stat(9, 0.10, 10)]  # seed 9 has no eta=0 run: left out
    d = st.paired(base, other)
    assert sorted(d["seeds"]) == [0, 1, 2, 3]
    g = d["gap_final"]  # points: 1, 2, 0, 3 -> mean 1.5, sd sqrt(5/3), t(3 df) = 3.182
    assert g["mean"] == pytest.approx(1.5) and g["n"] == 4
    assert g["half"] == pytest.approx(3.182 * (5 / 3) ** 0.5 / 2)
    assert (g["low"], g["high"]) == pytest.approx((1.5 - g["half"], 1.5 + g["half"]))
    assert d["wall_ratio"]["n"] == 3 and d["wall_ratio"]["mean"] == pytest.approx(0.6)  # seed 2 never reached 80%
    assert d["wall_ratio_smooth"] is None and d["traj_ratio"]["mean"] == pytest.approx(1.85)
    assert st.t_interval([2.0])["half"] is None and st.t_interval([None]) is None
    lines = st.paired_targets({"x-etaauto-decoupled vs eta=0": d})
    assert "within 1 points at the last step (upper bound +3.6): NOT met" in lines[0]
    assert "not every seed reached 80%" in lines[2]


def test_a_pair_that_differs_beyond_its_configuration_is_flagged(tmp_path):
    from tools.experiments import staleness_study as st

    job = {"name": "a-s0", "out_dir": "x/a-s0", "model": {"path": "m"}, "rl": {"eta": 0, "seed": 0, "lr": 1e-4}}
    runs = []
    for name, change in (("a", {}), ("b", {"eta": "auto", "eta_max": 8}), ("c", {"eta": 4, "seed": 1})):
        (tmp_path / name).mkdir()
        j = {**job, "name": name, "out_dir": name, "rl": {**job["rl"], **change}}
        (tmp_path / name / "job.json").write_text(json.dumps(j))
        runs.append(tmp_path / name)
    assert st.unpaired_fields(runs[0], runs[1]) == []
    assert st.unpaired_fields(runs[0], runs[2]) == ["rl.seed"]


def test_the_study_detaches_with_one_flag_and_logs_to_its_directory(tmp_path, capsys):
    """--background starts the same command in its own session (output in OUT/study.log) and returns at once."""
    import os

    from tools.experiments import staleness_study as st

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "warm_start.json").write_text(json.dumps(
        {"data_synthetic": {"task": "arithmetic"}, "max_new_tokens": 8, "heldout_accuracy": 0.4}))
    for eta in ("0", "4"):
        run = fake_run(tmp_path, f"{st.name_of(1e-4, eta, True)}-s0", [0.4, 0.7, 0.85, 0.9], [{"0": 10}] * 6, 1.0)
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    st.main([str(tmp_path), "--report", "--background", "--seeds", "1", "--configs", "1e-4:0:decoupled",
             "1e-4:4:decoupled"])
    out = capsys.readouterr().out
    assert "running in the background" in out
    os.waitpid(int(out.split("pid ")[1].split(",")[0]), 0)  # our child, though in its own session
    assert "eta4-decoupled vs eta=0 | 1 |" in (tmp_path / "paired.md").read_text()
    assert "Paired over seeds" in (tmp_path / "study.log").read_text()


def test_a_lag_scaled_configuration_is_parsed_named_and_paired_with_its_plain_one(tmp_path, capsys):
    """LR:ETA:OBJ:LAG runs rl.lr_lag_scale = LAG; the report sets it against eta=0 and against the same
    configuration without the scale."""
    import argparse

    from tools.experiments import staleness_study as st

    p = argparse.ArgumentParser()
    assert st.parse_configs(["1e-4:4:decoupled:0.25", "1e-4:0:naive"], p) == [(1e-4, "4", True, 0.25),
                                                                              (1e-4, "0", False, 0.0)]
    with pytest.raises(SystemExit):
        st.parse_configs(["1e-4:4:decoupled:0", "1e-4:4:decoupled:x:y"], p)
    assert "'1e-4:4:decoupled:0', '1e-4:4:decoupled:x:y'" in capsys.readouterr().err
    assert st.name_of(1e-4, "4", True, 0.25) == "lr0.0001-eta4lag0.25-decoupled"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "warm_start.json").write_text(json.dumps(
        {"data_synthetic": {"task": "arithmetic"}, "max_new_tokens": 8, "heldout_accuracy": 0.4}))
    for seed in (0, 1):
        for eta, lag, accs in (("0", 0, [0.4, 0.7, 0.85, 0.9]), ("4", 0, [0.4, 0.7, 0.8, 0.86]),
                               ("4", 0.25, [0.4, 0.7, 0.84, 0.89 - seed / 100])):
            run = fake_run(tmp_path, f"{st.name_of(1e-4, eta, True, lag)}-s{seed}", accs, [{"0": 10}] * 6, 1.0)
            (run / "final").mkdir()
            (run / "final" / "config.json").write_text("{}")
            rl = {"eta": int(eta), "seed": seed, **({"lr_lag_scale": lag} if lag else {})}
            (run / "job.json").write_text(json.dumps({"name": run.name, "out_dir": str(run), "rl": rl}))
    st.main([str(tmp_path), "--report", "--seeds", "2", "--configs", "1e-4:0:decoupled", "1e-4:4:decoupled",
             "1e-4:4:decoupled:0.25"])
    text = (tmp_path / "paired.md").read_text()
    assert "| lr0.0001-eta4lag0.25-decoupled vs eta=0 | 2 | 1.5 +- " in text  # 1 and 2 points below
    assert "| lr0.0001-eta4lag0.25-decoupled vs no lag scale | 2 | -2.5 +- " in text  # 3 and 2 points above
    assert "NOT PAIRED" not in text
