"""Multi-turn episodes on the rollout side: the engine generates turns, the environment (in its
worker pool) answers them, and this driver moves each episode between the two.

    driver = EpisodeDriver(engine, tokenizer, job.env, pool)
    driver.start(id, prompt_ids, problem, request_fields)   # the env's first observation, then turn 1
    for out in engine.step(): driver.on_turn(out)          # a turn ended: ask the environment
    for episode in driver.poll(wait_s): ...                # episodes that ended (reward, reason)

Token in, token out: an episode keeps the ids the model sampled, exactly, and each observation's
ids as tokenized once; the text is only what the environment reads. Every way an episode can go
wrong (see `Episode.reason`) ends that episode alone with reward 0; nothing waits on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from hexrl.envs import environment_class
from hexrl.envs.base import Problem, Step
from hexrl.envs.pool import EnvPool

from .engine import Engine
from .sequence import Finished, Request


@dataclass
class Episode:
    """One episode's tokens so far (`ids`: sampled and observation tokens; `mask` 1 where sampled)
    and how it ended: `reason` is the environment's ("answer", "unclosed_call", ...) or the
    driver's: "env_error", "env_timeout", "bad_observation", "bad_reward", "observation_too_long",
    "empty_observation", "max_turns", "context_length"."""

    id: str
    prompt_ids: list[int]
    problem: Problem
    request: Request  # the first turn's request (sampling fields for every turn)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # the model's turns as text, for the environment
    reward: float = 0.0
    reason: str = ""
    in_engine: bool = False  # added to the engine (and not yet released)

    @property
    def done(self) -> bool:
        return bool(self.reason)


class EpisodeDriver:
    """Runs a replica's episodes against `env` (the job's EnvSpec) through `pool` (an EnvPool)."""

    def __init__(self, engine: Engine, tokenizer, env, pool: EnvPool):
        self.engine, self.tokenizer, self.env, self.pool = engine, tokenizer, env, pool
        self.stop_strings = tuple(environment_class(env.name).stop_strings)
        self.episodes: dict[str, Episode] = {}  # running: in the engine or waiting for the environment
        self.calls: dict[int, Episode] = {}  # environment call ticket -> its episode
        self.ended: list[Episode] = []
        self.reasons: dict[str, int] = {}  # how episodes ended, counted

    @property
    def waiting(self) -> int:
        """Episodes waiting for their environment."""
        return len(self.calls)

    def start(self, request: Request, problem: Problem) -> None:
        """Begin an episode: ask the environment for its first observation (then turn 1 runs).
        `request` carries the id, the prompt and the sampling fields of every turn."""
        ep = Episode(str(request.id), list(request.prompt_ids), problem,
                     replace(request, episode=True, stop_strings=request.stop_strings + self.stop_strings))
        self.episodes[ep.id] = ep
        self.calls[self.pool.submit([("start", problem, [])])] = ep

    def on_turn(self, out: Finished) -> bool:
        """A turn came out of the engine: keep its sampled ids and ask the environment; False if
        `out` is not one of this driver's episodes."""
        ep = self.episodes.get(str(out.id))
        if ep is None:
            return False
        ep.ids += out.token_ids
        ep.mask += [1] * len(out.token_ids)
        ep.logprobs += out.logprobs
        ep.versions += out.versions
        ep.turns.append(self.tokenizer.decode(out.token_ids))
        self.calls[self.pool.submit([("step", ep.problem, ep.turns)])] = ep
        return True

    def poll(self, wait_s: float = 0.0) -> list[Episode]:
        """Apply the environment's replies that are back (waiting up to `wait_s`); returns the
        episodes that ended since the last call."""
        if self.calls:
            for ticket, (step,) in self.pool.finished(wait_s).items():
                self._reply(self.calls.pop(ticket), step)
        ended, self.ended = self.ended, []
        return ended

    def _reply(self, ep: Episode, step: Step) -> None:
        if step.done:
            return self._end(ep, step.reason or "answer", step.reward)
        if ep.turns and len(ep.turns) >= self.env.max_turns:
            return self._end(ep, "max_turns")
        if not ep.turns and not step.observation:  # no first observation: turn 1 runs on the prompt alone
            return self._add(ep, [])
        try:
            obs = self.tokenizer.encode(step.observation)
        except Exception:  # e.g. a character the tokenizer has no id for
            return self._end(ep, "bad_observation")
        if not obs:
            return self._end(ep, "empty_observation")
        if len(obs) > self.env.max_obs_tokens:
            return self._end(ep, "observation_too_long")
        room = self.engine.max_sequence_tokens - len(ep.prompt_ids) - len(ep.ids) - len(obs)
        if room < 1:
            return self._end(ep, "context_length")
        ep.ids += obs
        ep.mask += [0] * len(obs)
        if ep.in_engine:
            self.engine.extend(ep.id, obs, min(ep.request.max_new_tokens, room))
        else:
            self._add(ep, obs)

    def _add(self, ep: Episode, obs: list[int]) -> None:
        """Turn 1: the prompt and the first observation, if any, go to the engine."""
        room = self.engine.max_sequence_tokens - len(ep.prompt_ids) - len(obs)
        if room < 1:
            return self._end(ep, "context_length")
        self.engine.add(replace(ep.request, prompt_ids=ep.prompt_ids + obs,
                                max_new_tokens=min(ep.request.max_new_tokens, room)))
        ep.in_engine = True

    def _end(self, ep: Episode, reason: str, reward: float = 0.0) -> None:
        ep.reason, ep.reward = reason, reward
        if ep.in_engine:
            self.engine.release(ep.id)
            ep.in_engine = False
        del self.episodes[ep.id]
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.ended.append(ep)
