"""rl.eta = "auto" (hexrl/control/auto_eta.py): the rule on synthetic signals, the job field, the gate's
drop bound, the controller's hook, and the simulator running the same rule."""

import json
from types import SimpleNamespace

import pytest
from test_simulate import hetero_job

from hexrl.control.auto_eta import AutoEta
from hexrl.control.controller import Controller, ReplicaInfo
from hexrl.control.dataset import DatasetCursor
from hexrl.control.gate import StalenessGate
from hexrl.plan.planner import plan_job
from hexrl.plan.simulate import Simulation
from hexrl.schema import load_job
from hexrl.schema.fields import ConfigError

WAITS, BUSY = 0.5, 1.0  # a step whose trainer waited half of it for the batch, and one that did not
FED = 0.0


def run_plant(rule: AutoEta, spread_at, waits_below: int, steps: int) -> list[int]:
    """A toy pipeline: step t trains tokens at the lag the bound allowed one step earlier; their w_std is
    that lag times spread_at(t); the trainer waits while the bound is below `waits_below`."""
    etas, lag = [], 0
    for t in range(steps):
        wait = WAITS if rule.eta < waits_below else FED
        hist = {str(lag): 100} if lag else {"0": 100}
        lag = rule.eta
        etas.append(rule.update(wait, BUSY, hist and spread_at(t) * int(next(iter(hist))), hist))
    return etas


def test_the_bound_climbs_one_a_step_while_the_trainer_waits_and_the_spread_allows():
    rule = AutoEta(eta_max=4, target=0.1)
    assert rule.eta == 1  # never 0: at 0 no token is stale and nothing measures the spread
    etas = run_plant(rule, lambda t: 0.01, waits_below=10, steps=6)
    assert etas == [2, 3, 4, 4, 4, 4]  # up by one a step, then held at eta_max


def test_the_bound_stays_when_the_trainer_does_not_wait():
    rule = AutoEta(eta_max=8, target=0.1)
    etas = run_plant(rule, lambda t: 0.01, waits_below=3, steps=8)
    assert etas[-1] == 3 and max(etas) == 3  # more lag would buy nothing: the trainer is fed at 3


def test_one_slow_step_in_five_does_not_buy_lag():
    """The study's runs at eta 1: an evaluation takes the rollout's core and the next step waits ~20%,
    once in five steps; the others wait under 1%. The median share is ~0: the bound stays at 1."""
    rule = AutoEta(eta_max=4, target=0.1, per_version=0.01, waits=[0.0] * 5)
    etas = [rule.update(0.2 if t % 5 == 4 else 0.005, 1.0, 0.01, {"1": 100}) for t in range(40)]
    assert set(etas) == {1}
    etas = [rule.update(0.2 if t % 5 < 3 else 0.005, 1.0, 0.01, {"1": 100}) for t in range(10)]
    assert etas[-1] > 1  # three slow steps in five: generation is really behind, and it climbs


def test_the_bound_falls_at_once_when_the_spread_per_version_rises():
    """A policy that starts moving faster (a larger step per version): the spread per version goes
    0.01 -> 0.06, so the affordable lag drops from eta_max to floor(0.1 / 0.06) = 1."""
    rule = AutoEta(eta_max=4, target=0.1)
    etas = run_plant(rule, lambda t: 0.01 if t < 6 else 0.06, waits_below=10, steps=20)
    assert etas[5] == 4
    drop = next(i for i, e in enumerate(etas) if i > 5 and e < 4)
    assert drop <= 7  # within two steps (the spread per version is a 5-step average)
    assert all(a >= b for a, b in zip(etas[drop:], etas[drop + 1:]))  # never up again while it is high
    assert etas[-5:] == [1] * 5  # and it settles where the spread puts it
    assert rule.per_version == pytest.approx(0.06, rel=0.05)


def test_a_falling_spread_lets_the_bound_rise_again():
    """The decayed learning rate: the policy moves less per version late in the run, so more lag is cheap."""
    rule = AutoEta(eta_max=4, target=0.1)
    etas = run_plant(rule, lambda t: 0.06 if t < 10 else 0.03, waits_below=10, steps=30)
    assert set(etas[3:10]) == {1} and etas[-1] == 3  # floor(0.1 / 0.03) = 3


def test_a_mix_of_fresh_and_stale_tokens_is_not_read_as_a_larger_spread():
    """Half the tokens at lag 0 (w = 1) and half at lag 1 with std 0.08: w's std over all is 0.08 / sqrt(2)
    (about); per version that is 0.08, not 0.08 / sqrt(2) / 0.5 (the mean lag)."""
    rule = AutoEta(eta_max=4, target=0.1)
    rule.update(WAITS, BUSY, 0.08 / 2 ** 0.5, {"0": 50, "1": 50})
    assert rule.per_version == pytest.approx(0.08)


def test_steps_without_stale_tokens_leave_the_estimate_alone():
    rule = AutoEta(eta_max=4, target=0.1, per_version=0.05)
    rule.update(WAITS, BUSY, 0.0, {"0": 50})
    assert rule.per_version == 0.05 and rule.afford() == 2
    rule.load_state({"eta": 9, "per_version": 0.02})
    assert rule.eta == 4 and rule.afford() == 4 and rule.waits == []  # clamped; a pre-window state loads
    rule.load_state(json.loads(json.dumps({**rule.state(), "waits": [0.1, 0.2]})))
    assert rule.waits == [0.1, 0.2]
    with pytest.raises(ValueError):
        AutoEta(eta_max=0, target=0.1)


def test_a_signal_that_is_not_a_number_is_no_evidence():
    """A NaN w_std (a step whose importance weights overflowed) leaves the spread estimate as it was;
    a NaN or infinite wait counts as a step that did not wait. The bound moves only on real signals."""
    nan, inf = float("nan"), float("inf")
    rule = AutoEta(eta_max=4, target=0.1, per_version=0.04, waits=[WAITS] * 5)  # affords floor(0.1 / 0.04) = 2
    assert rule.update(WAITS, BUSY, nan, {"1": 100}) == 2 and rule.per_version == 0.04
    assert rule.update(WAITS, BUSY, inf, {"1": 100}) == 2 and rule.per_version == 0.04
    for wait, busy in ((nan, BUSY), (inf, BUSY), (WAITS, nan), (inf, inf)):
        assert rule.update(wait, busy, 0.04, {"1": 100}) == 2 and rule.waits[-1] == 0.0
    rule.update(FED, BUSY, 0.02, {"1": 100})  # the next real signal moves the estimate again
    assert rule.per_version == pytest.approx(0.8 * 0.04 + 0.2 * 0.02)


def job(**rl) -> dict:
    return {"model": {"preset": "tiny"}, "data": {"synthetic": {}}, "rl": {"batch_size": 4, **rl},
            "cluster": {"nodes": [{"gpu_type": "cpu", "gpus": 2}]}}


def test_eta_auto_is_a_checked_job_field():
    rl = load_job(job(eta="auto", eta_max=3, eta_w_std_target=0.05), check_paths=False).rl
    assert (rl.eta, rl.eta_bound, rl.eta_max, rl.eta_w_std_target) == ("auto", 3, 3, 0.05)
    assert rl.max_concurrent_rollouts == 4 * 4  # sized for the largest bound it may choose
    assert load_job(job(eta=2), check_paths=False).rl.eta_bound == 2
    again = load_job({**job(), "rl": rl.to_dict()}, check_paths=False).rl  # plan.json round trip
    assert again.eta == "auto" and again.eta_max == 3
    with pytest.raises(ConfigError) as e:
        load_job(job(eta="fast", eta_max=0, eta_w_std_target=0), check_paths=False)
    text = str(e.value)
    assert "rl.eta: must be an integer >= 0, null or \"auto\"" in text
    assert "rl.eta_max: must be >= 1" in text and "rl.eta_w_std_target: must be > 0" in text


def test_the_gate_drops_only_past_max_lag_when_eta_moves():
    gate = StalenessGate(batch_size=2, eta=1, max_lag=4)
    assert not gate.is_too_stale(oldest_version=6, trainer_version=9)  # lag 3 > eta 1, <= max_lag 4
    assert gate.is_too_stale(oldest_version=4, trainer_version=9) and gate.too_stale == 1
    assert StalenessGate(batch_size=2, eta=1).is_too_stale(6, 9)  # without max_lag: eta, as before


def test_the_controller_moves_its_gate_and_keeps_the_choice_across_a_resume():
    rl = load_job(job(eta="auto", eta_max=4), check_paths=False).rl
    make = lambda: Controller(rl, DatasetCursor(list(range(10))), lambda p: [1], [ReplicaInfo(0, 1.0)],  # noqa: E731
                              router=SimpleNamespace(rejected={}), vocab_size=64)
    c = make()
    assert c.gate.eta == 1 and c.gate.max_lag == 4
    assert c.choose_eta(0.5, 1.0, 0.01, {"1": 10}) == 2 and c.gate.eta == 2
    assert json.loads(json.dumps(c.state()))["auto_eta"]["eta"] == 2
    d = make()
    d.load_state(json.loads(json.dumps(c.state())))
    assert d.gate.eta == 2 and d.auto.per_version == pytest.approx(0.01)
    fixed = Controller(load_job(job(eta=3), check_paths=False).rl, DatasetCursor(list(range(10))), lambda p: [1],
                       [ReplicaInfo(0, 1.0)], router=SimpleNamespace(rejected={}), vocab_size=64)
    assert fixed.choose_eta(0.5, 1.0, 0.0, {"3": 1}) == 3 and "auto_eta" not in fixed.state()


def test_the_simulator_runs_the_same_rule():
    """On the heterogeneous 1.5B setting the trainer waits for generation, so auto climbs as far as the
    assumed spread per version allows, and never trains data staler than eta_max."""
    plan = plan_job(load_job({**hetero_job("auto"), "rl": {**hetero_job("auto")["rl"], "eta_max": 4}}),
                    use_profiles=False)
    etas = {}
    for spread in (0.01, 0.04, 0.2):
        sim = Simulation(plan, use_profiles=False, w_spread=spread)
        res = sim.run(steps=12, warmup=2)
        assert res.violations == 0 and max(res.staleness) <= 4
        etas[spread] = res.eta_by_step
    assert etas[0.01][0] == 2 and max(etas[0.01]) == 4  # one up per step the trainer waited
    assert all(b - a in (0, 1) for a, b in zip(etas[0.01], etas[0.01][1:]))
    assert max(etas[0.04]) == 2  # floor(0.1 / 0.04)
    assert set(etas[0.2][2:]) == {1}  # after the first stale batch is measured


def test_plan_simulate_prints_the_bound_auto_chose(tmp_path, capsys):
    from hexrl.plan.__main__ import main

    job = hetero_job("auto")
    plan_job(load_job(job), use_profiles=False).save(tmp_path / "plan.json")
    assert main(["simulate", str(tmp_path / "plan.json"), "--steps", "5", "--w-spread", "0.2"]) == 0
    assert "eta auto  : [2, 1, 1, 1, 1] after each step (w std 0.1 allowed)" in capsys.readouterr().out
