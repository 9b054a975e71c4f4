"""The distributed trainer (gloo, CPU) against a plain single-process GRPO step.

The reference is written from scratch here: whole-model forward per sequence, log_softmax,
the loss terms of hexrl.train.loss (checked by hand in test_train_loss.py),
torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW. Tolerances (float32): loss and
log-probs 2e-5 absolute, weights 2e-5 absolute after two AdamW steps at lr 1e-3.
"""
import random
from pathlib import Path

import pytest
import torch
from dist_utils import run_world

from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.train import TrainConfig, Trainer
from hexrl.train.checkpoint import gather_stage
from hexrl.train.export import checkpoint_weights, write_model_files
from hexrl.train.loss import equal_reward_groups, group_advantages, ppo_terms
from hexrl.train.packing import plan_step
from hexrl.trajectory import Trajectory

CONFIG = dict(lr=1e-3, warmup_steps=4, grad_clip=0.5, clip_low=0.1, clip_high=0.15, behav_cap=5.0,
              ppo_minibatches=2, micro_batch_tokens=24, bucket_mb=0.05)
TOL = dict(rtol=0, atol=2e-5)


def make_batch(seed: int = 0, groups: int = 4, n: int = 4) -> list[Trajectory]:
    """Random prompts/completions; behaviour log-probs spread so some tokens exceed the cap;
    group 0 has all-equal rewards (filtered)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for _ in range(n):
            p, c = rng.randint(2, 9), rng.randint(1, 12)
            out.append(Trajectory(
                group_id=g, prompt_ids=[rng.randrange(64) for _ in range(p)],
                completion_ids=[rng.randrange(64) for _ in range(c)],
                logprobs=[rng.uniform(-6.5, -2.0) for _ in range(c)], versions=[0] * c,
                reward=1.0 if g == 0 else float(rng.random() < 0.5) + rng.random() * 0.1))
    return out


def seq_logprobs(model, t: Trajectory, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of the completion tokens the model sampled (an episode's observations are context)."""
    ids = torch.tensor(t.prompt_ids + t.completion_ids)
    logits = model(ids[None, :-1])[0] / temperature
    completion = torch.tensor(t.completion_ids)[:, None]
    lp = torch.log_softmax(logits, -1)[len(t.prompt_ids) - 1:].gather(-1, completion)[:, 0]
    return lp if t.mask is None else lp[torch.tensor(t.mask, dtype=torch.bool)]


def reference_step(path, trajs, cfg: TrainConfig, version: int = 0):
    """One GRPO step in the plainest possible single-process form (by a trainer at `version`)."""
    model = load_pretrained(path)
    ref_model = load_pretrained(path) if cfg.kl_coef else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=0.0)
    rewards, gids = [t.reward for t in trajs], [t.group_id for t in trajs]
    adv = group_advantages(rewards, gids)
    seqs = [i for i, t in enumerate(trajs) if t.group_id not in equal_reward_groups(rewards, gids)]
    with torch.no_grad():
        prox = {i: seq_logprobs(model, trajs[i]) for i in seqs}
        ref = {i: seq_logprobs(ref_model, trajs[i]) for i in seqs} if ref_model else {}
    losses, norms, logprobs = [], [], {}
    for step, plan in enumerate(plan_step(trajs, seqs, adv, cfg.ppo_minibatches, 1, 10**9)):
        members = [i for mb in plan.micro_batches[0] for i in mb.seqs]
        if cfg.proximal == "minibatch":  # the weights as the earlier mini-batches left them
            with torch.no_grad():
                prox = {i: seq_logprobs(model, trajs[i]) for i in members}
        total = 0.0
        for i in members:
            t = trajs[i]
            lp = seq_logprobs(model, t)
            logprobs[i] = lp.detach()
            lag = torch.tensor([version - v for v in t.versions], dtype=lp.dtype)
            a = adv[i] / (1 + cfg.lr_lag_scale * lag)  # rl.lr_lag_scale: a smaller step for older tokens
            terms = ppo_terms(lp, prox[i], torch.tensor(t.logprobs), a, cfg.clip_low,
                              cfg.clip_high, cfg.behav_cap, cfg.decoupled, ref.get(i), cfg.kl_coef)
            total = total + terms.loss.sum()
        loss = total / sum(trajs[i].num_generated for i in members)
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item())
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)
        opt.step()
        losses.append(loss.item())
    return sum(losses) / len(losses), sum(norms) / len(norms), logprobs, model.state_dict()


def _train_worker(rank, world, path, layout, cfg, out_dir):
    trainer = Trainer(path, layout, TrainConfig(**cfg))
    batch = make_batch()
    first = trainer.step(batch)
    out = {"metrics": first, "logprobs": trainer.last_logprobs, "weights": gather_stage(trainer.model, trainer.grid)}
    if out_dir:
        trainer.export_hf(Path(out_dir) / "hf")  # all stages and TP shards gathered on one rank
        ckpt_dir = Path(out_dir) / "ck"  # resume: the step after a reload must repeat the step after the save
        trainer.save(ckpt_dir, extra={"cursor": 17})
        second = trainer.step(make_batch(seed=1))
        extra = trainer.load(ckpt_dir)
        again = trainer.step(make_batch(seed=1))
        out.update(second=second["loss"], again=again["loss"], extra=extra, version=trainer.version)
    return out


def run_and_compare(tmp_path, layout, world, model=None, **overrides):
    path = make_tiny_model(tmp_path / "m", layers=4, tie=True, **(model or {}))
    cfg = dict(CONFIG, **overrides)
    # 7-8 ranks on a small shared machine: minutes under load; a hung world is still killed
    results = run_world(_train_worker, world, str(path), layout, cfg, str(tmp_path), timeout=480)
    torch.set_num_threads(1)
    loss, norm, ref_logprobs, ref_weights = reference_step(path, make_batch(), TrainConfig(**cfg))
    metrics = results[0]["metrics"]
    assert all(r["metrics"] == metrics for r in results)  # metrics are reduced over all trainer ranks
    assert metrics["groups_filtered"] == 1 and metrics["optimizer_steps"] == 2 and metrics["capped_frac"] > 0
    assert metrics["loss"] == pytest.approx(loss, abs=2e-5)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)  # clipping engaged: norm > 0.5
    logprobs = {i: lp for r in results for i, lp in r["logprobs"].items()}
    assert sorted(logprobs) == sorted(ref_logprobs)
    for i, lp in ref_logprobs.items():
        torch.testing.assert_close(logprobs[i], lp, **TOL)
    weights = {}
    for r in results:
        weights.update(r["weights"] or {})
    assert set(weights) == set(ref_weights)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    exported = load_pretrained(tmp_path / "hf").state_dict()
    for name, w in ref_weights.items():
        torch.testing.assert_close(exported[name], w, **TOL, msg=lambda m, name=name: f"export {name}: {m}")
    write_model_files(tmp_path / "ck", path)  # the checkpoint (saved with the export's weights), joined from files
    _, joined = checkpoint_weights(tmp_path / "ck")
    assert set(joined) == set(ref_weights)
    for name, w in joined.items():
        torch.testing.assert_close(w, weights[name], rtol=0, atol=0, msg=lambda m, name=name: f"joined {name}: {m}")
    assert {r["again"] for r in results} == {results[0]["second"]}  # bit-identical resume
    assert results[0]["extra"] == {"cursor": 17} and results[0]["version"] == 2
    return results


def test_tp2_pp2_dp2_matches_single_process(tmp_path):
    layout = {"dp": 2, "stages": [{"tp": 2, "layers": [0, 2]}, {"tp": 2, "layers": [2, 4]}]}
    run_and_compare(tmp_path, layout, 8)


def test_mixed_tp_three_stages_with_kl_and_checkpointing(tmp_path):
    # TP 2 -> 1 -> 4: activations fan in then out; the tied embedding spans TP 2 and TP 4 shards
    layout = {"dp": 1, "stages": [{"tp": 2, "layers": [0, 1]}, {"tp": 1, "layers": [1, 3]},
                                  {"tp": 4, "layers": [3, 4]}]}
    run_and_compare(tmp_path, layout, 7, model=dict(kv_heads=4), kl_coef=0.05, activation_checkpointing=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_step_tracks_float32_cpu_step(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=4, tie=True)
    single = {"dp": 1, "stages": [{"tp": 1, "layers": [0, 4]}]}
    gpu = Trainer(path, single, TrainConfig(**CONFIG), device="cuda")  # dtype auto: bf16 compute, fp32 masters
    cpu = Trainer(path, single, TrainConfig(**CONFIG), device="cpu")
    got, want = gpu.step(make_batch()), cpu.step(make_batch())
    assert gpu.model.lm_head.weight.dtype == torch.bfloat16 and gpu.optimizer.master[0].dtype == torch.float32
    assert got["loss"] == pytest.approx(want["loss"], abs=5e-2) and got["tokens"] == want["tokens"]
    for i, lp in cpu.last_logprobs.items():
        torch.testing.assert_close(gpu.last_logprobs[i], lp, rtol=0, atol=5e-2)
