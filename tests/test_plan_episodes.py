"""The planner and the simulator know turns: an episode's observations are prefilled (only they:
the rest stays cached) and its environment's latency is waited out, so a tool-heavy job is not
priced as single-turn. The synchronous step by hand, as in test_simulate.py."""
import numpy as np
import pytest
from test_plan_cost import ATTN, KV_BYTES, MATMUL
from test_simulate import two_gpu_job

from hexrl.gpus import HOST_FIELDS, PAPER_DECODE_FACTOR
from hexrl.plan.cost import CostModel
from hexrl.plan.lengths import draw_latency, expected_max_wait
from hexrl.plan.planner import plan_job
from hexrl.plan.simulate import Simulation, split_turns
from hexrl.schema import ConfigError, load_job


def episode_job(latency=None, **rl) -> dict:
    """two_gpu_job's one group of 2 x 10 tokens, as episodes of two turns of 5 with a 16-token observation."""
    job = two_gpu_job(**rl)
    job["env"] = {"name": "retry", "max_turns": 2, "max_obs_tokens": 32}
    job["workload"].update(turns=2, obs_len=16, env_latency_s=latency or {"dist": "fixed", "mean": 0.5})
    return job


def test_a_synchronous_episode_step_matches_hand_computation():
    job = episode_job(eta=0)
    job["workload"]["host"] = {**dict.fromkeys(HOST_FIELDS, 0), "controller_us_per_traj": 50,
                               "controller_core_share": 1}  # the controller's cost per trajectory only
    plan = plan_job(load_job(job), use_profiles=False)
    sim = Simulation(plan, use_profiles=False)
    res = sim.run(steps=5, warmup=1, gantt_steps=5)
    f = PAPER_DECODE_FACTOR["H800"]
    bw, peak = 2e12 * 0.75 * f, 756e12 * 0.5 * f
    prompt = 2 * 2048 * (2 * MATMUL + 28 * ATTN * 1024) / peak
    # the observation: 16 tokens each, attending to the 2053 cached positions and their own (2061 on average)
    observation = 2 * 16 * (2 * MATMUL + 28 * ATTN * 2061) / peak
    turn1 = sum(2e-3 / f + 2 * MATMUL / bw + 2 * (2048 + k) * KV_BYTES / bw for k in range(5))
    turn2 = sum(2e-3 / f + 2 * MATMUL / bw + 2 * (2069 + k) * KV_BYTES / bw for k in range(5))
    spans = {}
    for lane, kind, t0, t1 in res.gantt:
        spans.setdefault((lane, kind), []).append(t1 - t0)
    assert spans[("R0", "prefill")] == pytest.approx([prompt, observation] * 5, rel=1e-9)
    assert spans[("R0", "decode")] == pytest.approx([turn1, turn2] * 5, rel=1e-9)
    train = spans[("trainer", "train")][0]
    host, latency, reward, control = 2 * 2 * 2e-4, 0.5, 0.01, 2 * 5e-5  # host work after each turn
    expect = prompt + turn1 + latency + observation + turn2 + host + reward + control + train + sim.cand.C_sync
    assert res.step_time_s == pytest.approx(expect, rel=1e-9)
    assert res.tokens_per_s == pytest.approx(2 * (2048 + 16 + 10) / expect, rel=1e-9)  # observations are trained on
    assert res.gen_tokens_per_s == pytest.approx(2 * 10 / expect, rel=1e-9)  # ... but not generated


def test_the_planner_prices_observation_prefill_and_environment_latency():
    single = CostModel(load_job(two_gpu_job(eta=0)), use_profiles=False)
    tools = CostModel(load_job(episode_job(eta=0)), use_profiles=False)
    obs = tools.rollout.observation_prefill_s("H800", 1)
    assert obs == pytest.approx(tools.prefill_s("H800", 1, 16, tools.w.ctx_decode))
    assert single.rollout.observation_prefill_s("H800", 1) == 0.0
    assert tools.decode_point("H800", 1, 2).tokens_per_s < single.decode_point("H800", 1, 2).tokens_per_s
    assert tools.w.tokens == 2 * (2048 + 16 + 10) and single.w.tokens == 2 * (2048 + 10)
    p1 = plan_job(load_job(two_gpu_job(eta=0)), use_profiles=False).predicted["step_time_s"]
    p2 = plan_job(load_job(episode_job(eta=0)), use_profiles=False).predicted["step_time_s"]
    assert p2 - p1 > 0.5  # at least the environment's wait: a tool-heavy job is not priced as single-turn
    sim = Simulation(plan_job(load_job(episode_job(eta=0)), use_profiles=False), use_profiles=False)
    assert sim.run(steps=5, warmup=1).step_time_s == pytest.approx(p2, rel=0.05)


def test_latency_draws_and_turn_splits():
    rng = np.random.default_rng(0)
    for spec in ({"dist": "exponential", "mean": 0.2}, {"dist": "lognormal", "mean": 0.2, "sigma": 1.0}):
        draws = [draw_latency(spec, rng) for _ in range(20000)]
        assert np.mean(draws) == pytest.approx(0.2, rel=0.05) and min(draws) >= 0
    assert draw_latency({"dist": "fixed", "mean": 0.3}, rng) == 0.3 and draw_latency(None, rng) == 0.0
    # the wave waits for the episode that waited longest: E[max of n sums], not the mean
    fixed, spread = {"dist": "fixed", "mean": 0.5}, {"dist": "lognormal", "mean": 0.5, "sigma": 1.0}
    assert expected_max_wait(fixed, 3, 100) == pytest.approx(1.5)
    assert expected_max_wait(spread, 3, 1) == pytest.approx(1.5, rel=0.15)
    assert expected_max_wait(spread, 3, 512) > 3 * expected_max_wait(spread, 3, 1)
    assert split_turns(10, 2, rng) == (5, 5, 5) and split_turns(10, 3, rng) == (4, 6, 4)
    assert split_turns(1, 4, rng) == (1, 0, 1)  # fewer tokens than turns: one turn
    turns = [1 + (split_turns(100, 2.5, rng)[1] > 50) for _ in range(2000)]
    assert np.mean(turns) == pytest.approx(1.5, abs=0.05)  # 2.5 turns: 2 or 3, evenly


def test_workload_turns_need_an_env_within_its_limits():
    job = episode_job()
    job["workload"].update(turns=3, obs_len=64, env_latency_s={"dist": "gamma", "mean": -1})
    with pytest.raises(ConfigError) as e:
        load_job(job)
    for field in ("workload.turns", "workload.obs_len", "workload.env_latency_s.dist", "workload.env_latency_s.mean"):
        assert field in str(e.value)
    plain = two_gpu_job()
    plain["workload"].update(turns=2, env_latency_s={"dist": "fixed", "mean": 1})
    with pytest.raises(ConfigError, match="only a job with an env"):
        load_job(plain)
    job = episode_job()
    job["workload"]["output_len"] = {"samples": [20]}  # two turns of rl.max_new_tokens 10
    assert load_job(job).workload.output_len == {"samples": [20]}
    job["workload"]["output_len"] = {"samples": [21]}
    with pytest.raises(ConfigError, match="env.max_turns x rl.max_new_tokens 20"):
        load_job(job)


@pytest.mark.slow
def test_a_tool_heavy_hetero_plan_agrees_with_its_simulation():
    """8 H800 + 8 H20, 1.5B, eta 0, episodes of 4 turns with 256-token observations and lognormal
    environment latency (mean 0.5 s, sigma 1): planner within 10% of the simulation (-5% here; with
    the mean wait instead of the longest episode's it was -13%), and well above single-turn."""
    from test_simulate import hetero_job

    from hexrl.plan.simulate import simulate

    job = hetero_job(0)
    job["env"] = {"name": "retry", "max_turns": 4, "max_obs_tokens": 512}
    job["workload"].update(turns=4, obs_len=256, env_latency_s={"dist": "lognormal", "mean": 0.5, "sigma": 1.0})
    plan = plan_job(load_job(job), use_profiles=False)
    res = simulate(plan, steps=6, warmup=2, use_profiles=False)
    assert res.step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=0.10)
    single = plan_job(load_job(hetero_job(0)), use_profiles=False).predicted["step_time_s"]
    assert plan.predicted["step_time_s"] > single + 5


def test_the_longest_wait_of_many_long_episodes_is_bounded():
    """1,000 turns x 4,096 prompts x 16 samples: 999 waits for each of 65,536 episodes (the Monte Carlo
    wanted 97.6 GiB for its 200 trials). Past MC_DRAWS each episode's total is drawn whole: exact for a
    fixed latency, a gamma for an exponential one."""
    fixed, expo = {"dist": "fixed", "mean": 0.5}, {"dist": "exponential", "mean": 0.2}
    assert expected_max_wait(fixed, 999, 65536) == pytest.approx(499.5)
    mean, sd = 999 * 0.2, 0.2 * 999 ** 0.5  # the sum of 999 exponentials: a gamma, about normal
    assert mean + 3.5 * sd < expected_max_wait(expo, 999, 65536) < mean + 5 * sd  # E[max of 65,536] ~ 4.3 sd
    lognormal = expected_max_wait({"dist": "lognormal", "mean": 0.5, "sigma": 1.0}, 999, 65536)
    assert 999 * 0.5 < lognormal < 999 * 0.5 * 1.5
    job = episode_job({"dist": "lognormal", "mean": 0.05, "sigma": 1.0}, batch_size=4096, group_size=16)
    job["env"]["max_turns"] = 1000
    job["workload"].update(turns=1000, obs_len=1)
    step = plan_job(load_job(job), use_profiles=False).predicted["step_time_s"]
    assert 999 * 0.05 < step < float("inf")  # the environment's waits at least
