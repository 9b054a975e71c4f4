"""Requests in, finished outputs out, and the per-sequence state the engine keeps in between."""
from __future__ import annotations

from dataclasses import dataclass, field

PENDING = -1  # a sampled token id still on its way back from the device (overlapped steps)


@dataclass
class Prefix:
    """What a sequence generated before it moved engines: its tokens, and per token the behaviour
    log-prob and the weight version of the sampler that produced it (kept as they are: the loss
    needs the sampler's own)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]

    def problems(self, name: str, vocab_size: int, max_new_tokens: int) -> list[str]:
        """Everything wrong with this prefix of the request `name`, as readable sentences."""
        p, n = [], len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            p.append(f"{name}: prefix has {n} token_ids, {len(self.logprobs)} logprobs and "
                     f"{len(self.versions)} versions: one of each per token")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in self.token_ids):
            p.append(f"{name}: prefix token_ids must be ids in [0, {vocab_size})")
        if any(not isinstance(v, (int, float)) or not v <= 0 for v in self.logprobs):  # NaN fails too
            p.append(f"{name}: prefix logprobs must be numbers <= 0")
        if any(not isinstance(v, int) or v < 0 for v in self.versions):
            p.append(f"{name}: prefix versions must be integers >= 0")
        if isinstance(max_new_tokens, int) and n >= max_new_tokens:
            p.append(f"{name}: a prefix of {n} tokens leaves nothing of max_new_tokens ({max_new_tokens}) "
                     "to generate")
        return p


@dataclass
class Request:
    """One prompt to complete.

    temperature 0 is greedy; top_k 0 and top_p 1.0 are off. `seed` fixes the sampling noise of
    this request (token i draws with (seed, i)), so a request samples the same tokens whatever
    batch it lands in; None lets the engine pick one. Generation stops at the engine's EOS ids
    (unless `ignore_eos`), at any of `stop_ids`, at any of `stop_strings` (needs the engine's
    tokenizer), or after `max_new_tokens`.

    `prefix`: the request resumes a sequence another engine started (see `Engine.withdraw`): it is
    prefilled with prompt + prefix (its KV recomputed) and samples on from there; `max_new_tokens`
    counts the prefix, and the seed's stream continues where the prefix ended.
    """

    id: object
    prompt_ids: list[int]
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    episode: bool = False
    prefix: Prefix | None = None

    def problems(self, vocab_size: int) -> list[str]:
        """Everything wrong with this request, as readable sentences."""
        p, name = [], f"request {self.id!r}"
        if not self.prompt_ids:
            p.append(f"{name}: prompt_ids is empty")
        bad = [t for t in self.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            p.append(f"{name}: prompt_ids has ids outside [0, {vocab_size}): {bad[:5]}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            p.append(f"{name}: max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            p.append(f"{name}: temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            p.append(f"{name}: top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            p.append(f"{name}: top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if any(not s for s in self.stop_strings):
            p.append(f"{name}: stop_strings must not contain an empty string")
        if self.prefix is not None:
            p += self.prefix.problems(name, vocab_size, self.max_new_tokens)
            if self.episode:
                p.append(f"{name}: an episode cannot resume from a prefix")
        return p


@dataclass
class Finished:
    """A completed request (or, for an episode, a completed turn): the ids generated in it (EOS/stop
    id included), and per token the behaviour log-prob and the weight version that produced it."""

    id: object
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "eos" | "stop" | "length"


@dataclass(eq=False)  # identity semantics: hashed and compared by identity, never by token lists
class Sequence:
    """A request in flight: its tokens so far, its KV pages, and how many of its tokens are cached."""

    req: Request
    seed: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # block table
    num_cached: int = 0  # tokens whose k/v are in `pages`
    arrival: int = 0  # admission order; the newest are preempted first
    slot: int = -1  # row in the engine's per-slot tables while running, else -1
    stop_ids: frozenset = frozenset()  # token ids that end it (EOS unless ignored, and req.stop_ids)
    max_tokens: int = 0  # prompt + max_new_tokens
    mode: int = 0  # sampler.GREEDY / PLAIN / FILTERED
    done: bool = False  # finished: pages and slot released (rows of it in a step in flight are dropped)
    turn: int = 0  # turns ended so far (an episode's rows in a step in flight of an ended turn are dropped)
    turn_start: int = 0  # index in `tokens` of this turn's first generated token
    turn_logprobs: int = 0  # index in `logprobs` / `versions` of the same

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_uncached(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) - self.num_cached

    def finish(self, reason: str) -> Finished:
        """The current turn (for a single-turn request, the whole completion) as a Finished."""
        a, b = self.turn_start or self.num_prompt, self.turn_logprobs
        return Finished(self.req.id, list(self.req.prompt_ids), self.tokens[a:], self.logprobs[b:],
                        self.versions[b:], reason)
