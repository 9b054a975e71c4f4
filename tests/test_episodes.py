"""Episodes end to end on the rollout side: token in, token out (the trained ids are the sampled
ids, never a re-tokenized transcript), the wire format and the controller's checks of the mask,
and hostile environments and models, each ending only its own episode with a named reason."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hexrl.comm import wire
from hexrl.comm.wire import MessageError, message
from hexrl.control.admission import Dispatched, token_limits, trajectory_problem
from hexrl.control.buffer import ReplayBuffer
from hexrl.control.gate import StalenessGate
from hexrl.data.tokenizer import DEFAULT_ALPHABET, CharTokenizer
from hexrl.envs import Problem
from hexrl.envs.pool import EnvPool
from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.episodes import EpisodeDriver
from hexrl.rollout.rollout_rank import PendingGroup, episode_messages, trajectory_messages
from hexrl.rollout.sequence import Finished
from hexrl.schema.job import EnvSpec
from hexrl.train.packing import build_micro_batch
from hexrl.trajectory import Trajectory

TOK = CharTokenizer(DEFAULT_ALPHABET + "<>")


def test_trained_ids_are_the_sampled_ids_not_a_retokenized_transcript(tmp_path):
    """A random char-level model samples pad/bos ids mid-text: decoding drops them, so the
    transcript re-tokenizes differently; the trajectory still holds exactly what was sampled."""
    model = load_pretrained(make_tiny_model(tmp_path / "m", seed=0, vocab=TOK.vocab_size, tie=False))
    engine = Engine(model, EngineConfig(page_size=4, max_pages=256), tokenizer=TOK)
    sampled: dict[str, list[Finished]] = {}
    env = EnvSpec("env_fixtures:Chatty", max_turns=4)
    with EnvPool(env.name, {}, workers=1, timeout_s=30) as pool:
        driver = EpisodeDriver(engine, TOK, env, pool)
        prompt = TOK.encode("12+30=")
        for i in range(4):
            driver.start(Request(f"0:{i}", prompt, max_new_tokens=8, temperature=1.0, seed=i), Problem("12+30="))
        ended = []
        while len(ended) < 4:
            for out in engine.step():
                sampled.setdefault(out.id, []).append(out)
                driver.on_turn(out)
            ended += driver.poll(0.01 if not engine.has_work() else 0.0)
    group = PendingGroup({"group_id": 0, "n": 4, "prompt_ids": prompt, "problem_id": 7},
                         {int(e.id.split(":")[1]): e for e in ended})
    trajs = [wire.msg_to_trajectory(wire.decode(wire.encode(m))) for m in episode_messages(group, rank=0)]
    retokenized_differs = False
    for i, t in enumerate(trajs):
        turns, ids = sampled[f"0:{i}"], t.completion_ids.tolist()
        gen = t.completion_ids[t.generated_positions()].tolist()
        assert gen == [x for out in turns for x in out.token_ids]  # exactly the sampled ids
        assert t.logprobs.tolist() == [x for out in turns for x in out.logprobs] and len(t.versions) == len(gen)
        obs = t.completion_ids[t.mask == 0].tolist()
        assert obs == TOK.encode(" ok ") + TOK.encode("\nobs 1\n") + TOK.encode("\nobs 2\n")  # tokenized once
        assert t.finish_reason == "answer" and t.reward == 1.0 and t.meta == {"turns": 3}
        retokenized_differs |= TOK.encode(TOK.decode(ids)) != ids
        mb = build_micro_batch(trajs, [i], [1.0] * 4)  # what the trainer trains on
        assert mb.targets.tolist() == gen and mb.behav.tolist() == t.logprobs.tolist()
        assert mb.input_ids.tolist() == (prompt + ids)[:-1]
    assert retokenized_differs  # the premise: a re-tokenized transcript would have trained other ids
    while engine.has_work():  # the releases of the last episodes apply at the next step
        engine.step()
    assert engine.pool.num_free == engine.pool.num_pages and not engine._live


def test_the_leaders_messages_arrive_as_the_values_it_sampled(tmp_path):
    """A group sampled by the real engine and sent as the rollout leader sends it: the Trajectory the
    controller files holds typed arrays equal to the engine's lists (each float32 log-prob exactly as
    sampled), and the trainer's micro-batch from it is the one from those lists, bit for bit."""
    model = load_pretrained(make_tiny_model(tmp_path / "m", seed=0, vocab=TOK.vocab_size, tie=False))
    engine = Engine(model, EngineConfig(page_size=4, max_pages=64), tokenizer=TOK)
    prompt = TOK.encode("12+30=")
    for i in range(4):
        engine.add(Request(f"0:{i}", prompt, max_new_tokens=12, temperature=1.0, seed=i))
    outputs = {}
    while engine.has_work():
        outputs.update({int(out.id.split(":")[1]): out for out in engine.step()})
    rewards = [1.0, 0.0, 0.0, 1.0]
    group = PendingGroup({"group_id": 0, "n": 4, "prompt_ids": prompt, "problem_id": 7}, outputs, start_version=0)
    trajs = [wire.msg_to_trajectory(wire.decode(wire.encode(m))) for m in trajectory_messages(group, rewards, 0)]
    sampled = [Trajectory(0, prompt, o.token_ids, o.logprobs, o.versions, reward=r, finish_reason=o.finish_reason,
                          problem_id=7) for o, r in zip((outputs[i] for i in range(4)), rewards)]
    for t, want in zip(trajs, sampled):
        assert [a.dtype for a in (t.prompt_ids, t.completion_ids, t.logprobs, t.versions)] == [
            np.int32, np.int32, np.float32, np.int32]
        assert t == want and t.logprobs.tolist() == want.logprobs  # no log-prob rounded on the way
    adv = [1.0, -1.0, -1.0, 1.0]
    got, expect = build_micro_batch(trajs, [0, 1, 2, 3], adv), build_micro_batch(sampled, [0, 1, 2, 3], adv)
    for name, value in vars(expect).items():
        mine = getattr(got, name)
        assert (torch.equal(mine, value) and mine.dtype == value.dtype) if torch.is_tensor(value) else mine == value


# ----------------------------------------------------------------------------- wire and controller


WIRE_DTYPES = {"prompt_ids": np.int32, "completion_ids": np.int32, "mask": np.uint8, "logprobs": np.float32,
               "versions": np.int32}


def masked(**over) -> dict:
    """An episode's trajectory message; token fields given as lists become the wire's typed arrays."""
    fields = dict(group_id=1, prompt_ids=[1], completion_ids=[5, 6, 7, 8], mask=[1, 0, 0, 1], logprobs=[-1.0, -2.0],
                  versions=[0, 1], start_version=0, reward=1.0, finish_reason="answer")
    fields.update(over)
    return message("trajectory", **{k: np.array(v, WIRE_DTYPES[k]) if isinstance(v, list) and k in WIRE_DTYPES else v
                                    for k, v in fields.items()})


def test_the_mask_travels_and_is_validated_like_every_field():
    t = wire.msg_to_trajectory(wire.decode(wire.encode(masked())))
    assert t.mask.tolist() == [1, 0, 0, 1] and t.num_generated == 2 and t.generated_positions().tolist() == [0, 3]
    for bad, why in [(dict(mask=[1, 0, 1]), "mask has 3 values"), (dict(mask=[1, 0, 2, 1]), "0 .environment. or 1"),
                     (dict(mask=[1, 1, 0, 1]), "differ in length"),
                     (dict(mask=np.array([-1, 0, 1, 1], np.int8)), "'mask' should be uint8.* got 1-D int8 array"),
                     (dict(mask=np.float32([1.0, 0.0, 0.0, 1.0])), "'mask' should be uint8")]:
        with pytest.raises(MessageError, match=why):
            wire.encode(masked(**bad))
    assert wire.msg_to_trajectory(wire.decode(wire.encode(masked(mask=None, logprobs=[-1.0] * 4,
                                                                 versions=[0] * 4)))).mask is None


@dataclass
class RL:
    max_new_tokens: int = 2


def test_the_controller_bounds_episodes_by_turns_and_observations():
    sent = Dispatched(0, None, [1])
    single, episodes = token_limits(RL()), token_limits(RL(), EnvSpec("calculator", max_turns=2, max_obs_tokens=3))
    assert (single.generated, single.completion) == (2, 2) and (episodes.generated, episodes.completion) == (4, 10)
    assert trajectory_problem(masked(), sent, 0, 100, single, 1) == "bad_tokens"  # 4 tokens: not single-turn
    assert trajectory_problem(masked(), sent, 0, 100, episodes, 1) is None
    assert trajectory_problem(masked(completion_ids=[5] + [6] * 10, mask=[1] + [0] * 10, logprobs=[-1.0],
                                     versions=[0]), sent, 0, 100, episodes, 1) == "bad_tokens"
    assert trajectory_problem(masked(), sent, 0, 100, episodes, 0) == "bad_versions"


def test_the_start_version_is_validated_like_every_field():
    for bad, why in [(dict(start_version="3"), "'start_version' should be int"),
                     (dict(start_version=True), "'start_version' should be int")]:
        with pytest.raises(MessageError, match=why):
            wire.encode(masked(**bad))
    missing = masked()
    del missing["start_version"]
    with pytest.raises(MessageError, match="missing field 'start_version'"):
        wire.encode(missing)
    sent, limits = Dispatched(0, None, [1]), token_limits(RL(), EnvSpec("calculator", max_turns=2, max_obs_tokens=3))
    assert trajectory_problem(masked(start_version=1), sent, 0, 100, limits, 1) is None
    for future in (2, -1):  # started under weights the trainer never published
        assert trajectory_problem(masked(start_version=future), sent, 0, 100, limits, 1) == "bad_versions"


def test_the_buffer_refuses_an_inconsistent_mask():
    buf = ReplayBuffer(filter_equal_rewards=False)
    buf.expect(0, 2)
    good = Trajectory(0, [1], [5, 6, 7], [-1.0, -1.0], [0, 0], mask=[1, 0, 1])
    assert buf.add(good) == "pending"
    assert buf.add(Trajectory(0, [1], [5, 6, 7], [-1.0, -1.0], [0, 0], mask=[1, 1, 1])) == "dropped"
    assert buf.accounting()["balanced"]


# ----------------------------------------------------------------------------- hostile environments and models


class FakeEngine:
    """The engine calls the driver makes, recorded; turns are fed by the test (a scripted model)."""

    max_sequence_tokens = 56

    def __init__(self):
        self.live, self.calls = {}, []

    def add(self, request: Request):
        assert request.episode and request.stop_strings == ("</calc>",)
        self.live[request.id] = len(request.prompt_ids)
        self.calls.append(("add", request.id))

    def extend(self, id, ids, max_new_tokens):
        assert id in self.live and max_new_tokens >= 1
        self.calls.append(("extend", id, len(ids)))

    def release(self, id):
        del self.live[id]


SCRIPTS = {  # episode -> its model turns, and how it must end
    "ok": (["<calc>1+2</calc>", "3"], "answer", 1.0),
    "wrong": (["4"], "answer", 0.0),
    "unclosed": (["<calc>1+2+"], "unclosed_call", 0.0),
    "calls_forever": (["<calc>1</calc>"] * 3, "max_turns", 0.0),
    "raise": (["raise"], "env_error", 0.0),
    "hang": (["hang"], "env_timeout", 0.0),
    "mega": (["mega"], "observation_too_long", 0.0),
    "big": (["big"], "observation_too_long", 0.0),
    "weird": (["weird"], "bad_observation", 0.0),
    "bytes": (["bytes"], "bad_observation", 0.0),
    "empty": (["empty"], "empty_observation", 0.0),
    "long": (["<calc>" + "1" * 40 + "</calc>"], "context_length", 0.0),
}


def test_hostile_environments_and_models_end_only_their_episode():
    engine, env = FakeEngine(), EnvSpec("env_fixtures:Scripted", max_turns=3, max_obs_tokens=100)
    with EnvPool(env.name, {}, workers=2, timeout_s=2.0) as pool:
        driver = EpisodeDriver(engine, TOK, env, pool)
        for name in SCRIPTS:
            driver.start(Request(name, TOK.encode("1+2="), max_new_tokens=50), Problem("1+2=", "3"))
        turn, ended = {name: 0 for name in SCRIPTS}, {}
        while len(ended) < len(SCRIPTS):
            for name, count in list(turn.items()):  # the scripted model answers each episode's turn
                if name in engine.live and name in driver.episodes and _ready(driver, name, count):
                    ids = TOK.encode(SCRIPTS[name][0][count])
                    turn[name] += 1
                    driver.on_turn(Finished(name, [], ids, [-1.0] * len(ids), [0] * len(ids), "stop"))
            ended.update({e.id: e for e in driver.poll(0.05)})
    for name, (_, reason, reward) in SCRIPTS.items():
        e = ended[name]
        assert (e.reason, e.reward) == (reason, reward), name
        assert sum(e.mask) == len(e.logprobs) == len(e.versions) and len(e.mask) == len(e.ids)
    assert driver.reasons == {"answer": 2, **{r: 1 for r in ("unclosed_call", "max_turns", "env_error", "env_timeout",
                                                                "context_length", "empty_observation")},
                              "observation_too_long": 2, "bad_observation": 2}
    assert not engine.live and not driver.episodes and not driver.calls  # every episode released, nothing left
    assert len(ended["calls_forever"].mask) == 3 * 14 + 2 * 2 and ended["calls_forever"].mask.count(0) == 4


def _ready(driver, name, count) -> bool:
    """The episode is waiting for the model (its last call answered) and has `count` turns."""
    ep = driver.episodes[name]
    return len(ep.turns) == count and ep not in driver.calls.values()


@pytest.mark.parametrize("options, reason", [({}, "env_error"), ({"bad_observation": 1}, "bad_observation")])
def test_an_episode_that_ends_before_its_first_turn_has_the_version_it_started_under(options, reason):
    """No model turn, so no sampled token carries a version: the trajectory still has one (the
    weights the engine had when its group arrived), and a fresh group is not dropped as stale."""
    from types import SimpleNamespace

    from hexrl.rollout import rollout_rank

    engine, env = FakeEngine(), EnvSpec("env_fixtures:FailsAtStart", options=options)
    engine.version = 3
    sent = []
    leader = object.__new__(rollout_rank.RolloutLeader)  # only what starting and sending a group touch
    leader.engine, leader.tokenizer, leader.rank, leader.groups = engine, TOK, 0, {}
    leader.time = rollout_rank.LeaderTime()
    leader.channel = SimpleNamespace(send=lambda msg, timeout_s: sent.append(msg) or True)
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    with EnvPool(env.name, env.options, workers=1, timeout_s=30) as pool:
        leader.episodes = EpisodeDriver(engine, TOK, env, pool)
        leader._add_group({"group_id": 5, "n": 2, "prompt_ids": TOK.encode("1+2="), "problem_id": 0,
                           "sampling": sampling, "version": 3})
        while len(sent) < 2:
            leader._send_scored(0.05)
    trajs = [wire.msg_to_trajectory(wire.decode(wire.encode(m))) for m in sent]
    assert [(t.finish_reason, t.versions.tolist(), t.start_version, t.oldest_version) for t in trajs] == [
        (reason, [], 3, 3)] * 2
    gate = StalenessGate(batch_size=1, eta=1)
    buf = ReplayBuffer(gate, filter_equal_rewards=False)
    assert gate.try_acquire(3)
    buf.expect(5, 2)
    assert [buf.add(t) for t in trajs] == ["pending", "accepted"]
    assert [g.group_id for g in buf.pop_batch(1, trainer_version=4)] == [5] and gate.too_stale == 0


# ----------------------------------------------------------------------------- the whole job


def test_a_run_with_an_environment_trains_on_episodes(tmp_path):
    """torchrun on CPU with the retry environment: an untrained model answers wrong, is told so and
    tries again; episodes of two turns are trained on and every trajectory is accounted for."""
    from runtime_utils import metrics, torchrun, write_job

    plan = write_job(tmp_path, steps=2, eta=1, env={"name": "retry", "max_turns": 2, "timeout_s": 5, "workers": 1})
    proc = torchrun(plan, tmp_path / "run")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["trajectories_produced"] == (r["trajectories_trained"] + r["trajectories_filtered"] +
                                              r["trajectories_dropped"] + r["trajectories_pending"])
        assert r["rejected_messages"] == 0 and r["tokens_trained"] > 0
        # an untrained model never answers right: each episode ran out of turns, after two
        assert r["finish_reasons"] == {"max_turns": 4} and r["turns_mean"] == 2.0
