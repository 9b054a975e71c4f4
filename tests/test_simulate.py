"""The discrete-event simulator: a hand-computed synchronous step, the staleness gate, agreement
with the planner's prediction, and the CLI."""

import importlib.util
import json
from pathlib import Path

import pytest
from test_plan_cost import ATTN, HEAD, KV_BYTES, LAYER, MATMUL  # the 1.5B model's shape, by hand

from hexrl.gpus import PAPER_DECODE_FACTOR
from hexrl.plan.__main__ import main
from hexrl.plan.cost import CostModel
from hexrl.plan.planner import plan_job
from hexrl.plan.simulate import Simulation, simulate
from hexrl.schema import load_job


def demo_job() -> dict:
    """tools/configs/cpu_demo.json with the tiny preset in place of the demo's warm-started checkpoint."""
    return {**json.loads((CONFIGS / "cpu_demo.json").read_text()), "model": {"preset": "tiny"}}


CONFIGS = Path(__file__).resolve().parent.parent / "tools" / "configs"


def two_gpu_job(**rl) -> dict:
    """One H800 trains the 1.5B model, one generates; every prompt is 2048 tokens, every output 10."""
    return {
        "model": {"preset": "r1-distill-qwen-1.5b"}, "data": {"synthetic": {}},
        "rl": {"batch_size": 1, "group_size": 2, "max_new_tokens": 10, **rl},
        "workload": {"prompt_len": 2048, "output_len": {"samples": [10]}, "reward_s_per_sample": 0.01},
        "cluster": {"nodes": [{"gpu_type": "H800", "gpus": 2}]},
        "layout": {"train_gpus": 1},
    }


def hetero_job(eta) -> dict:
    nodes = [{"name": f"{t.lower()}-{i}", "gpu_type": t, "gpus": 4} for t in ("H800", "H20") for i in range(2)]
    return {
        "model": {"preset": "r1-distill-qwen-1.5b"}, "data": {"synthetic": {}},
        "rl": {"batch_size": 64, "group_size": 8, "max_new_tokens": 4096, "eta": eta, "ppo_minibatches": 2},
        "workload": {"prompt_len": 256, "output_len": {"mean": 1500, "max": 4096}},
        "cluster": {"nodes": nodes, "inter_node_GBps": 5, "cross_type_GBps": 1.5},
    }


# host costs of the hand-computed step, large enough to show (hexrl.gpus.Host's fields)
HOST = {"controller_us_per_traj": 40, "controller_ns_per_token": 1000, "controller_us_per_group": 20,
        "publish_us_per_replica": 0, "handoff_ns_per_token_rank0": 100, "handoff_ns_per_token_other": 10,
        "controller_core_share": 0.5}


def test_synchronous_step_matches_hand_computation():
    """One group of 2 x 10 tokens a step, from prompts of 2048, every term by hand from the model's
    shape (test_plan_cost.py) and the H800's datasheet: 756 TFLOP/s, 2 TB/s (hexrl/gpus.py), and
    the job's host costs: the controller's work on half a core, the batch hand-off before training."""
    job = two_gpu_job(eta=0)
    job["workload"]["host"] = HOST
    plan = plan_job(load_job(job), use_profiles=False)
    sim = Simulation(plan, use_profiles=False)
    res = sim.run(steps=5, warmup=1, gantt_steps=5)
    f = PAPER_DECODE_FACTOR["H800"]  # the paper-fitted share of the roofline the rollout reaches
    bw, peak = 2e12 * 0.75 * f, 756e12 * 0.5 * f  # HBM bytes/s and FLOP/s of decode and prefill
    # both prompts prefilled together: 2 FLOPs a parameter and causal attention (context 1024) per token
    prefill = 2 * 2048 * (2 * MATMUL + 28 * ATTN * 1024) / peak
    # 10 decode steps at batch 2 (weights read once a step), step k reading 2 x (2048 + k) positions of KV
    decode = sum(2e-3 / f + 2 * MATMUL / bw + 2 * (2048 + k) * KV_BYTES / bw for k in range(10))
    # training 2 x 2058 tokens: fwd + bwd and the proximal forward (4 passes) at train_mfu 0.40; then one
    # minibatch's optimizer step streams 16 bytes a parameter in and out at 2 TB/s
    train = (4 * 2 * 2058 * (28 * (2 * LAYER + ATTN * 2058 / 2) + 2 * HEAD) / (756e12 * 0.40)
             + 2 * 16 * (28 * LAYER + 2 * HEAD) / 2e12)
    host = 2 * 2e-4  # host_s_per_sample: the leader hands both samples over before scoring
    reward = 0.01  # the two samples scored side by side on the replica's 2 reward workers
    # the controller takes both in (2 x 40 us + 20 generated tokens x 1 us) and hands the group out
    # (20 us), on half a core
    control = (2 * 40e-6 + 20 * 1e-6 + 20e-6) / 0.5
    handoff = 2 * 2058 * 110e-9  # every trained token packed on rank 0 (100 ns), unpacked (10 ns)
    spans = {}
    for lane, kind, t0, t1 in res.gantt:
        spans.setdefault((lane, kind), []).append(t1 - t0)
    assert spans[("R0", "prefill")] == pytest.approx([prefill] * 5, rel=1e-9)
    assert spans[("R0", "decode")] == pytest.approx([decode] * 5, rel=1e-9)
    assert spans[("trainer", "train")] == pytest.approx([train] * 5, rel=1e-9)
    assert spans[("trainer", "handoff")] == pytest.approx([handoff] * 5, rel=1e-9)
    assert spans[("controller", "control")] == pytest.approx([control] * 5, rel=1e-9)
    expect = prefill + decode + host + reward + control + handoff + train + sim.cand.C_sync  # the plan's weight sync
    assert res.step_time_s == pytest.approx(expect, rel=1e-9)
    assert res.staleness == {0: 10} and res.violations == 0
    assert res.tokens_per_s == pytest.approx(2 * 2058 / expect, rel=1e-9)


def test_gate_keeps_synchronous_runs_fresh_and_async_runs_overlapping():
    sync = simulate(plan_job(load_job(hetero_job(0)), use_profiles=False), steps=6, use_profiles=False)
    assert set(sync.staleness) == {0} and sync.violations == 0
    free = simulate(plan_job(load_job(hetero_job(None)), use_profiles=False), steps=6, use_profiles=False)
    assert max(free.staleness) >= 2  # unbounded staleness: old trajectories do get trained on
    assert free.tokens_per_s > 1.5 * sync.tokens_per_s  # overlap pays
    for res in (sync, free):
        assert 0 <= res.idle["train"] <= 1 and 0 <= res.idle["rollout"] <= 1


def test_simulator_runs_the_runtime_gate_and_buffer():
    """The simulator's control side is the runtime's code: groups more than eta versions old are
    dropped by the ReplayBuffer (counted by the StalenessGate), never trained on."""
    from hexrl.control.buffer import ReplayBuffer
    from hexrl.control.gate import StalenessGate
    sim = Simulation(plan_job(load_job(hetero_job(1)), use_profiles=False), use_profiles=False)
    assert isinstance(sim.gate, StalenessGate) and isinstance(sim.buffer, ReplayBuffer)
    res = sim.run(steps=8)
    assert max(res.staleness) <= 1 and res.violations == 0
    assert res.dropped_stale == sim.gate.too_stale * sim.G  # every stale group counted once
    acc = sim.buffer.accounting()
    assert acc["balanced"] and acc["trained"] == 8 * sim.B * sim.G


def paper_job(eta) -> dict:
    """The paper's 1.5B setting on 24 H800 + 24 H20 (tools/configs/paper_1.5b_hetero.json)."""
    job = json.loads((CONFIGS / "paper_1.5b_hetero.json").read_text())
    job["rl"]["eta"] = eta
    return job


@pytest.mark.slow
@pytest.mark.parametrize("eta", [0, 1, 4, None])
def test_simulation_agrees_with_the_planner_on_the_paper_setting(eta):
    """Planner and simulator agree within 5% on the paper's setting, over an even window of
    steps (at eta = 1 they alternate long, short)."""
    plan = plan_job(load_job(paper_job(eta), check_paths=False))
    res = simulate(plan, steps=20, warmup=4)
    assert res.violations == 0
    assert res.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=0.05)


def test_the_gate_alternation_at_eta_1_is_priced():
    """1.5B on 32 H800 at eta = 1: with training and generation nearly balanced, steps alternate
    between training alone and waiting for a wave that the next step's groups slowed down
    (CostModel.joined_wave). The planner's step was 20% short of the simulation before it priced that."""
    job = json.loads((CONFIGS / "paper_1.5b_h800.json").read_text())
    job["rl"]["eta"] = 1
    plan = plan_job(load_job(job, check_paths=False))
    res = simulate(plan, steps=12, warmup=4)
    assert res.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=0.05)


@pytest.mark.parametrize("eta", [0, 1, 2, None])
def test_a_plan_recosts_to_its_own_prediction(eta):
    """`plan simulate` costs the placement a plan describes (hexrl/plan/fixed.py): that must give
    the planner's own prediction. (At eta = 1 it did not: each replica's running batch was capped
    at an even part of the gate's (eta + 1) * B * G, not its share, so the 2-GPU H800 replica was
    costed at 114 running sequences instead of the 256 the planner gave it.)"""
    from hexrl.plan.planner import plan_candidate
    plan = plan_job(load_job(hetero_job(eta)), use_profiles=False)
    cand = plan_candidate(CostModel(plan.job, use_profiles=False), plan)
    assert cand.step_s == pytest.approx(plan.predicted["step_time_s"], rel=1e-3)
    assert [r.batch for r in cand.rollout.replicas] == [r.knobs.max_running for r in plan.replicas]


def test_rewards_are_scored_while_the_replica_decodes():
    """As in the rollout leader, a finished group goes to the reward workers and its replica
    decodes on: scoring intervals overlap decoding, and the planner predicts the step the
    simulator runs with a slow reward (0.05 s a sample, 0.2 s a group) as with a fast one."""
    job = hetero_job(0)
    job["workload"]["reward_s_per_sample"] = 0.05
    plan = plan_job(load_job(job), use_profiles=False)
    res = simulate(plan, steps=5, warmup=1, gantt_steps=2, use_profiles=False)
    spans = {}
    for lane, kind, t0, t1 in res.gantt:
        spans.setdefault((lane, kind), []).append((t0, t1))
    scored = spans[("R0 reward", "reward")]
    decoding = spans[("R0", "decode")]
    assert any(a0 < b1 and b0 < a1 for a0, a1 in scored for b0, b1 in decoding)
    assert res.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=0.05)


def test_host_work_per_sample_holds_up_the_replica():
    """Between decode steps the rollout leader hands finished samples to the reward workers and
    sends their trajectories: the simulator charges host_s_per_sample for each on the replica's
    own lane, so a slow host slows generation by about samples x host time, as the planner prices it."""
    plan = plan_job(load_job(hetero_job(0)), use_profiles=False)
    fast = Simulation(plan, use_profiles=False)
    slow = Simulation(plan, use_profiles=False)
    for s, host in ((fast, 0.0), (slow, 2e-3)):
        for r in s.replicas.values():
            r.host_s = host
    a, b = fast.run(steps=4, warmup=1, gantt_steps=1), slow.run(steps=4, warmup=1, gantt_steps=1)
    assert not any(kind == "host" for _, kind, _, _ in a.gantt) and any(kind == "host" for _, kind, _, _ in b.gantt)
    per_replica = 64 * 8 / sum(1 for r in plan.replicas if r.share > 0)  # samples each replica finishes per step
    assert 0.5 * per_replica * 2e-3 < b.step_time_s - a.step_time_s < 1.5 * per_replica * 2e-3


def test_controller_work_takes_the_trainers_core_only_while_it_trains_and_shares_it():
    """The controller process takes arriving groups in one after another (its own lane). Sharing
    trainer rank 0's cores (a core share below 1), the trajectories it takes in during a training
    step make that step longer by their work each (eta = 2); at eta = 0 none arrive while the
    trainer trains (the gate is shut), so no training step is lengthened; with a core of its own
    (share 1) it never lengthens one."""
    def run(eta, control_s, share=0.5):
        sim = Simulation(plan_job(load_job(hetero_job(eta)), use_profiles=False), use_profiles=False)
        sim.control_s, sim.control_share = control_s, share  # per trajectory, the controller's only cost here
        sim.control_token_s = sim.group_s = sim.handoff_token_s = 0.0
        arrivals = []  # when each scored group reaches the controller
        arrive = sim.arrive
        sim.arrive = lambda t, gid: (arrivals.append(t), arrive(t, gid))
        res = sim.run(steps=6, warmup=2, gantt_steps=6)
        spans = {(lane, kind): [(t0, t1) for ln, k, t0, t1 in res.gantt if (ln, k) == (lane, kind)]
                 for lane in ("trainer", "controller") for kind in ("train", "control")}
        return res.trainer_busy * res.step_time_s, spans, arrivals, sim

    quiet, _, _, _ = run(2, 0.0)
    busy, spans, arrivals, sim = run(2, 2e-3)
    charged, control = spans[("trainer", "control")], spans[("controller", "control")]
    assert charged and control
    # exactly the groups that arrive while the trainer trains (its train spans and what they were
    # lengthened by) are charged to it, G x 2 ms each
    training = spans[("trainer", "train")] + charged
    during = sum(any(t0 <= t < t1 for t0, t1 in training) for t in arrivals)
    assert 0 < during < len(arrivals)
    assert sum(t1 - t0 for t0, t1 in charged) == pytest.approx(during * sim.G * 2e-3, rel=1e-9)
    # at most every trajectory of a step (B x G) arrives during its training; at eta = 2 the next
    # step's groups decode while it trains and over half of them arrive then (246 of 450 groups
    # here): a training step grows by a quarter of B x G x 2 ms at least
    assert 0.25 * sim.B * sim.G * 2e-3 <= busy - quiet <= 1.05 * sim.B * sim.G * 2e-3
    _, spans, _, sim = run(0, 2e-3)
    control = spans[("controller", "control")]
    assert not spans[("trainer", "control")] and len(control) >= 6 * sim.B  # every group, one at a time
    assert all(b0 >= a1 - 1e-12 for (_, a1), (b0, _) in zip(control, control[1:]))
    own_core, spans, _, _ = run(2, 2e-3, share=1.0)
    assert not spans[("trainer", "control")] and own_core < busy  # the trainer is never charged


def test_filtered_groups_are_generated_again():
    """With workload.equal_reward_fraction f, the simulator's buffer filters about f of the groups
    (random, seeded) as the runtime does, and they are generated again; at eta = 0 the planner
    prices the rounds of regeneration (a wave each) within 10% of the simulation (-4.5% here)."""
    job = hetero_job(0)
    job["workload"]["equal_reward_fraction"] = 0.5
    plan = plan_job(load_job(job), use_profiles=False)
    sim = Simulation(plan, use_profiles=False)
    res = sim.run(steps=6, warmup=2)
    acc = sim.buffer.accounting()
    assert acc["balanced"] and acc["trained"] == 6 * sim.B * sim.G
    filtered = acc["filtered"]["equal_rewards"]
    assert 0.4 < filtered / (filtered + acc["trained"]) < 0.6
    assert res.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=0.10)


@pytest.mark.parametrize("f,eta", [(0.5, 2), (0.8, 1)])
def test_filtered_groups_at_eta_1_and_up_are_priced(f, eta):
    """At eta >= 1, filtering makes the staleness gate, not the GPUs, cap what runs: of (eta + 1) B
    groups some wait accepted, and a running group decodes only mean / E[max] of its samples. The
    planner prices that (CostModel.gated_gen_s) within 10% of the simulation; without it the
    simulation ran 29% (f = 0.5, eta = 2) and 63% (f = 0.8, eta = 1) slower than predicted."""
    job = hetero_job(eta)
    job["workload"]["equal_reward_fraction"] = f
    plan = plan_job(load_job(job), use_profiles=False)
    res = Simulation(plan, use_profiles=False).run(steps=20, warmup=4)
    assert res.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=0.10)


def test_gantt_lanes_do_not_overlap():
    res = simulate(plan_job(load_job(hetero_job(2)), use_profiles=False), steps=5, gantt_steps=2,
                   use_profiles=False)
    lanes: dict = {}
    for lane, _kind, t0, t1 in res.gantt:
        lanes.setdefault(lane, []).append((t0, t1))
    assert "trainer" in lanes and len(lanes) > 2
    for spans in lanes.values():
        spans.sort()
        assert all(b0 >= a1 - 1e-9 for (_, a1), (b0, _) in zip(spans, spans[1:]))


def test_cli(tmp_path, capsys):
    plan = plan_job(load_job(demo_job()))
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "sim.json"
    drawn = importlib.util.find_spec("matplotlib") is not None  # without it: exit 1, the rest still written
    assert main(["simulate", str(tmp_path / "plan.json"), "--steps", "6", "--json", str(out),
                 "--gantt", str(tmp_path / "g.png")]) == (0 if drawn else 1)
    assert (tmp_path / "g.png").exists() == drawn
    text = capsys.readouterr().out
    assert "tokens/s" in text and "staleness" in text
    assert json.loads(out.read_text())["steps"] == 6
    assert "{" not in text  # staleness is a table, not a Python dict
    bad = plan.to_dict()
    bad["ranks"][0]["role"] = "critic"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["simulate", str(tmp_path / "bad.json")]) == 2
    assert "unknown role 'critic'" in capsys.readouterr().err


def test_staleness_prints_as_a_table():
    from hexrl.plan.__main__ import staleness_table

    assert staleness_table({0: 120, 1: 8, 12: 3}) == ["  versions behind   0  1  12",
                                                      "  trajectories    120  8   3"]
