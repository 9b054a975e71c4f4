"""The rollout engine against Hugging Face `generate` (greedy), and its batching invariants:
admissions mid-batch, chunked prefill, preemption under KV pressure, interrupts by weight updates."""
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from hexrl.comm.wire import RESUME_FIELDS, decode, encode, message
from hexrl.model.hf_checkpoint import load_pretrained, save_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Prefix, Request
from hexrl.rollout.rollout_rank import LeaderTime, RolloutLeader, sample_request

transformers = pytest.importorskip("transformers")
VOCAB = 256


def tiny_checkpoint(path: Path, arch: str = "qwen2", seed: int = 0) -> Path:
    """A random tiny checkpoint with a sharpened lm_head, so greedy picks have no near-ties."""
    make_tiny_model(path, seed=seed, arch=arch, vocab=VOCAB, tie=False)
    model = load_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    return {name: tiny_checkpoint(root / name, arch, seed)
            for name, arch, seed in [("qwen2", "qwen2", 0), ("llama", "llama", 1), ("qwen2-b", "qwen2", 2)]}


@lru_cache(maxsize=None)
def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], n: int, eos: int | None = 2) -> list[int]:
    """Hugging Face greedy continuation (batch of one: no padding), stopping after eos like ours."""
    out = hf_model(path).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def greedy(pid, prompt, n, **kw) -> Request:
    return Request(pid, prompt, max_new_tokens=n, temperature=0.0, **kw)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_transformers_with_many_pages_and_admissions(ckpts, arch):
    path = ckpts[arch]
    ps = prompts([3, 11, 6, 17, 1, 9], seed=1)
    # page_size 4: many pages per sequence; max_running 3: the other requests join mid-batch
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64, max_running=3,
                                                        max_batch_tokens=32))
    for i, p in enumerate(ps[:4]):
        engine.add(greedy(i, p, 14))
    outs = {}
    for _ in range(3):
        outs.update({f.id: f for f in engine.step()})
    for i, p in enumerate(ps[4:], start=4):  # added while others are decoding
        engine.add(greedy(i, p, 14))
    while engine.has_work():
        outs.update({f.id: f for f in engine.step()})
    assert sorted(outs) == list(range(len(ps)))
    for i, p in enumerate(ps):
        ref = hf_greedy(path, p, 14)
        assert outs[i].token_ids == ref, f"prompt {i}"
        assert outs[i].finish_reason == ("eos" if ref[-1] == 2 else "length")
        assert len(outs[i].logprobs) == len(ref) and all(lp <= 0 for lp in outs[i].logprobs)
        assert outs[i].versions == [0] * len(ref)
    assert engine.pool.num_free == engine.pool.num_pages  # every page came back
    assert engine.stats.generated_tokens == sum(len(o.token_ids) for o in outs.values())


def test_greedy_logprobs_are_log_softmax_of_hf_logits(ckpts):
    path = ckpts["qwen2"]
    p = prompts([7], seed=2)[0]
    out = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=16)).generate([greedy("x", p, 6)])[0]
    ids = torch.tensor([p + out.token_ids])
    ref = torch.log_softmax(hf_model(path)(ids).logits[0, len(p) - 1:-1].double(), -1)
    ref = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_chunked_prefill_equals_unchunked(ckpts):
    path = ckpts["qwen2"]
    ps = prompts([150, 5, 40], seed=3)
    reqs = [greedy(i, p, 10, ignore_eos=True) for i, p in enumerate(ps)]
    whole = Engine(load_pretrained(path), EngineConfig(page_size=8, max_pages=128, max_batch_tokens=512))
    chunked = Engine(load_pretrained(path), EngineConfig(page_size=8, max_pages=128, max_batch_tokens=16))
    a, b = whole.generate(reqs), chunked.generate(reqs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [len(o.token_ids) for o in b] == [10, 10, 10]
    torch.testing.assert_close(torch.tensor([o.logprobs for o in a]), torch.tensor([o.logprobs for o in b]),
                               atol=1e-4, rtol=0)
    assert chunked.stats.steps > whole.stats.steps  # it really was chunked
    assert b[0].token_ids == hf_greedy(path, ps[0], 10, eos=None)


def test_too_few_pages_preempts_and_still_finishes_identically(ckpts):
    path = ckpts["llama"]
    ps = prompts([10, 13, 7, 12, 9], seed=4)
    reqs = [greedy(i, p, 24, ignore_eos=True) for i, p in enumerate(ps)]
    roomy = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=100)).generate(reqs)
    # 9 pages hold 36 tokens; each request needs up to 37 / 4 -> 10 pages at the end
    tight = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=10))
    outs = tight.generate(reqs)
    assert tight.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    assert tight.pool.num_free == tight.pool.num_pages
    assert outs[0].token_ids == hf_greedy(path, ps[0], 24, eos=None)


def run_with_interrupts(engine, reqs, weights_at: dict[int, tuple]) -> dict:
    """Step `engine` over `reqs`; before step k in `weights_at`, update_weights(*weights_at[k])."""
    for r in reqs:
        engine.add(r)
    outs, k = {}, 0
    while engine.has_work():
        if k in weights_at:
            engine.update_weights(*weights_at[k])
        outs.update({f.id: f for f in engine.step()})
        k += 1
    return outs


def test_interrupt_with_same_weights_changes_nothing(ckpts):
    path = ckpts["qwen2"]
    ps = prompts([5, 9, 3, 12], seed=5)
    reqs = [greedy(i, p, 16, ignore_eos=True) for i, p in enumerate(ps)]
    # sampled requests too: per-request seeds make their draws independent of recompute
    reqs += [Request(10 + i, p, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=i) for i, p in enumerate(ps)]
    cfg = EngineConfig(page_size=4, max_pages=100, max_running=5)
    plain = run_with_interrupts(Engine(load_pretrained(path), cfg), reqs, {})
    model = load_pretrained(path)
    same = {k: v.clone() for k, v in model.state_dict().items()}
    engine = Engine(model, cfg)
    interrupted = run_with_interrupts(engine, reqs, {3: (same, 1), 7: (same, 2), 8: (same, 3)})
    assert engine.stats.interrupts == 3
    for r in reqs:
        a, b = plain[r.id], interrupted[r.id]
        assert b.token_ids == a.token_ids and len(b.token_ids) == 16
        assert b.versions == sorted(b.versions) and b.versions[-1] == 3  # versions say what produced each token
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


def test_interrupt_with_new_weights_continues_from_the_prefix(ckpts):
    path_a, path_b = ckpts["qwen2"], ckpts["qwen2-b"]
    ps = prompts([6, 10, 4, 8, 5], seed=6)
    reqs = [greedy(i, p, 12, ignore_eos=True) for i, p in enumerate(ps)]
    engine = Engine(load_pretrained(path_a), EngineConfig(page_size=4, max_pages=100, max_running=3))
    new = load_pretrained(path_b).state_dict()
    outs = run_with_interrupts(engine, reqs, {5: (new, 1)})
    switched = 0
    for i, p in enumerate(ps):
        o = outs[i]
        assert len(o.token_ids) == 12 and len(o.versions) == 12 and len(o.logprobs) == 12
        j = o.versions.count(0)  # tokens produced before the switch
        assert o.versions == [0] * j + [1] * (12 - j)
        assert o.token_ids[:j] == hf_greedy(path_a, p, 12, eos=None)[:j]
        assert o.token_ids[j:] == hf_greedy(path_b, p + o.token_ids[:j], 12 - j, eos=None)
        switched += 0 < j < 12
    assert switched >= 2  # some sequences really were cut mid-generation
    assert engine.version == 1 and engine.pool.num_free == engine.pool.num_pages


def test_a_withdrawn_group_resumes_on_another_engine_as_if_it_had_not_moved(ckpts):
    path = ckpts["qwen2"]
    ps = prompts([5, 9, 3, 12, 7], seed=8)
    group = [Request(f"g:{i}", ps[0], max_new_tokens=16, temperature=1.0, top_k=30, seed=40 + i, ignore_eos=True)
             for i in range(4)]
    group.append(greedy("g:4", ps[0], 16, ignore_eos=True))
    others = [greedy(i, p, 16, ignore_eos=True) for i, p in enumerate(ps[1:])]
    cfg = EngineConfig(page_size=4, max_pages=100, max_running=8)  # overlap on: withdraw drains the step in flight
    same = {k: v.clone() for k, v in load_pretrained(path).state_dict().items()}
    unmoved = run_with_interrupts(Engine(load_pretrained(path), cfg), group + others, {6: (same, 1)})

    source, target = Engine(load_pretrained(path), cfg), Engine(load_pretrained(path), cfg)
    target.update_weights(same, 1)
    for r in group + others:
        source.add(r)
    outs = {}
    for _ in range(6):
        outs.update({f.id: f for f in source.step()})
    source.update_weights(same, 1)  # the interruption: every sequence would be recomputed here anyway
    assert all(0 < source.progress()[r.id] < 16 for r in group) and len(source.progress()) == len(group + others)
    prefixes = source.withdraw([r.id for r in group])
    assert sorted(prefixes) == [r.id for r in group] and all(0 < len(x.token_ids) < 16 for x in prefixes.values())
    for r in group:
        target.add(replace(r, prefix=prefixes[r.id]))
    for engine in (source, target):
        while engine.has_work():
            outs.update({f.id: f for f in engine.step()})
    for r in group + others:
        a, b = unmoved[r.id], outs[r.id]
        assert b.token_ids == a.token_ids and b.versions == a.versions and len(b.token_ids) == 16
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    for r in group:  # the prefix's log-probs are the source sampler's own, carried over exactly
        n = len(prefixes[r.id].token_ids)
        assert outs[r.id].logprobs[:n] == prefixes[r.id].logprobs and outs[r.id].versions[:n] == [0] * n
    assert source.pool.num_free == source.pool.num_pages and not source.has_work()
    recomputed = sum(len(r.prompt_ids) + len(prefixes[r.id].token_ids) - 1 for r in group)  # less the sampled row
    assert target.stats.prefill_tokens == recomputed  # the moved KV, computed once there


def test_withdraw_leaves_finished_requests_and_bad_prefixes_are_refused(ckpts):
    path = ckpts["qwen2"]
    p = prompts([6], seed=9)[0]
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64, overlap=False), eos_ids=[2])
    engine.add(greedy("short", p, 2, ignore_eos=True))
    engine.add(greedy("long", p, 12, ignore_eos=True))
    engine.add(greedy("in flight", p, 4, ignore_eos=True))
    done = {f.id for _ in range(3) for f in engine.step()}
    engine.config.overlap = True  # the next (decode) step's tokens stay in flight: "in flight" finishes in them
    assert engine.step() == []
    engine.add(greedy("queued", p, 12, ignore_eos=True))
    assert engine.progress() == {"long": 4, "queued": 0}
    taken = engine.withdraw(["short", "long", "in flight", "queued", "nobody"])
    assert done == {"short"} and sorted(taken) == ["in flight", "long", "queued"]
    assert taken["in flight"].finish_reason == "length" and len(taken["in flight"].token_ids) == 4
    assert len(taken["long"].token_ids) == len(taken["long"].versions) == 4 and taken["queued"].token_ids == []
    assert not engine.has_work() and engine.step() == [] and engine.pool.num_free == engine.pool.num_pages
    with pytest.raises(ValueError) as e:
        engine.add(replace(greedy("bad", p, 12), prefix=Prefix([5, 2], [-0.1], [0, 0])))
    msg = str(e.value)
    assert "1 logprobs" in msg and "stop or EOS id" in msg  # every problem at once
    with pytest.raises(ValueError, match="leaves nothing of max_new_tokens"):
        engine.add(replace(greedy("full", p, 2), prefix=Prefix([5, 6], [-0.1, -0.2], [0, 0])))
    with pytest.raises(ValueError, match="an episode cannot resume"):
        engine.add(replace(greedy("ep", p, 12), episode=True, prefix=Prefix([5], [-0.1], [0])))


class Outbox:
    """A DealerChannel stand-in: keeps what is sent, through the wire."""

    def __init__(self):
        self.sent = []

    def send(self, msg: dict, timeout_s: float = 0) -> bool:
        self.sent.append(decode(encode(msg)))
        return True


def leader(engine) -> RolloutLeader:
    """A replica's leader around `engine`, without its sockets and reward workers: it keeps what it
    sends, and the groups it would score."""
    lead = RolloutLeader.__new__(RolloutLeader)
    lead.engine, lead.rank, lead.channel, lead.groups, lead.time = engine, 0, Outbox(), {}, LeaderTime()
    lead.scored = []
    lead._score = lead.scored.append
    return lead


def test_a_group_handed_back_over_the_wire_resumes_on_another_replica_as_if_unmoved(ckpts):
    path = ckpts["qwen2"]
    msg = message("prompt", group_id=3, problem_id=1, prompt_ids=prompts([7], seed=10)[0], n=4, version=0,
                  sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 30, "max_new_tokens": 16, "seed": 9})
    cfg = EngineConfig(page_size=4, max_pages=100, max_running=8)
    same = {k: v.clone() for k, v in load_pretrained(path).state_dict().items()}
    requests = [sample_request(msg, i) for i in range(msg["n"])]
    unmoved = run_with_interrupts(Engine(load_pretrained(path), cfg), requests, {5: (same, 1)})

    source, target = leader(Engine(load_pretrained(path), cfg)), leader(Engine(load_pretrained(path), cfg))
    source._add_group(msg)
    for _ in range(5):
        source._collect(source.engine.step())
    report = source._progress(1)  # what it sends when a weight update asks for a report
    assert list(report["group_ids"]) == [3] * 4 and all(0 < n <= 5 for n in report["generated"])
    source.engine.update_weights(same, 1)
    source._hand_back([3, 99])  # the controller withdraws it (99: a group it does not hold)
    back = source.channel.sent[-1]
    assert back["type"] == "withdrawn" and list(back["lengths"]) == list(report["generated"])
    assert 3 not in source.groups and not source.engine.has_work() and len(source.channel.sent) == 1
    target._add_group(decode(encode({**msg, "resume": {k: back[k] for k in RESUME_FIELDS}})))  # sent on
    target.engine.update_weights(same, 1)
    while target.engine.has_work():
        target._collect(target.engine.step())
    (moved,) = target.scored
    for i, r in enumerate(requests):
        a, b = unmoved[r.id], moved.outputs[i]
        assert b.token_ids == a.token_ids and b.versions == a.versions and b.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    assert moved.start_version == 0  # the group's own, as where it started


def test_stop_ids_eos_and_seeded_sampling(ckpts):
    path = ckpts["llama"]
    p = prompts([8], seed=7)[0]
    free = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64), eos_ids=[]).generate(
        [greedy("a", p, 12)])[0].token_ids
    stop = free[4]
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64), eos_ids=[free[6]])
    by_stop, by_eos = engine.generate([greedy("s", p, 12, stop_ids=(stop,), ignore_eos=True), greedy("e", p, 12)])
    assert by_stop.token_ids == free[:free.index(stop) + 1] and by_stop.finish_reason == "stop"
    assert by_eos.token_ids == free[:free.index(free[6]) + 1] and by_eos.finish_reason == "eos"

    def sampled(rid, seed):
        return Request(rid, p, max_new_tokens=10, temperature=1.0, top_k=20, seed=seed, ignore_eos=True)

    alone = engine.generate([sampled("x", 5)])[0]
    crowd = engine.generate([sampled("y", 6), sampled("x", 5), sampled("z", 7)])
    assert crowd[1].token_ids == alone.token_ids  # a seeded draw does not depend on its batch
    assert crowd[0].token_ids != alone.token_ids


def test_stop_strings_with_a_tokenizer(tmp_path):
    from hexrl.data.tokenizer import CharTokenizer

    path = make_tiny_model(tmp_path / "m", vocab=64, tokenizer="char")
    tok = CharTokenizer()
    model = load_pretrained(path)
    p = tok.encode("12+7=")
    free = Engine(model, EngineConfig(page_size=4, max_pages=32), eos_ids=[]).generate([greedy(0, p, 12)])[0]
    text = tok.decode(free.token_ids)
    if len(text) < 3:
        pytest.skip("the random model produced too few printable characters")
    target = text[1:3]
    out = Engine(model, EngineConfig(page_size=4, max_pages=32), eos_ids=[], tokenizer=tok).generate(
        [greedy(0, p, 12, stop_strings=(target,))])[0]
    assert out.finish_reason == "stop" and target in tok.decode(out.token_ids)
    assert target not in tok.decode(out.token_ids[:-1]) and free.token_ids[:len(out.token_ids)] == out.token_ids


def test_bad_requests_and_configs_are_reported_at_once(ckpts):
    with pytest.raises(ValueError, match="page_size must be an integer >= 1.*attention must be"):
        Engine(load_pretrained(ckpts["qwen2"]), EngineConfig(page_size=0, attention="tpu"))
    with pytest.raises(ValueError, match="attention='flashinfer' needs a CUDA model in fp16/bf16"):
        Engine(load_pretrained(ckpts["qwen2"]), EngineConfig(max_pages=8, attention="flashinfer"))
    engine = Engine(load_pretrained(ckpts["qwen2"]), EngineConfig(page_size=4, max_pages=8))
    with pytest.raises(ValueError, match=r"outside \[0, 256\).*max_new_tokens must be.*top_p must be"):
        engine.add(Request(1, [5, 999], max_new_tokens=0, top_p=0.0))
    with pytest.raises(ValueError, match="exceed the KV pool \\(32 tokens"):
        engine.add(Request(2, [5] * 20, max_new_tokens=20))
    with pytest.raises(ValueError, match="stop_strings need the engine to have a tokenizer"):
        engine.add(Request(3, [5], stop_strings=("x",)))
    engine.add(Request(4, [5], max_new_tokens=2))
    with pytest.raises(ValueError, match="already queued"):
        engine.add(Request(4, [6], max_new_tokens=2))
    with pytest.raises(ValueError, match="missing model.norm.weight.*unexpected foo"):
        sd = dict(engine.model.state_dict(), foo=torch.zeros(1))
        sd.pop("model.norm.weight")
        engine.update_weights(sd, 1)


def test_a_flood_of_prompts_cannot_starve_the_rollout_loop():
    """The leader handles at most MAX_MESSAGES_PER_POLL messages per loop turn, so decoding and
    heartbeats go on however fast the controller sends."""
    from collections import deque
    from types import SimpleNamespace

    from hexrl.rollout import rollout_rank

    class Channel:
        def __init__(self, msgs):
            self.queue = deque(msgs)

        def recv(self, timeout_s):
            return self.queue.popleft() if self.queue else None

    added = []
    leader = object.__new__(rollout_rank.RolloutLeader)  # only what _poll touches
    leader.engine = SimpleNamespace(has_work=lambda: bool(added), add=added.append, version=0)
    leader.groups, leader.scoring = {}, {}
    sampling = {"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    flood = [{"type": "prompt", "group_id": g, "n": 1, "prompt_ids": [1, 5], "sampling": sampling}
             for g in range(rollout_rank.MAX_MESSAGES_PER_POLL + 10)]
    leader.channel = Channel(flood + [{"type": "stop"}])
    assert leader._poll() is True and len(added) == rollout_rank.MAX_MESSAGES_PER_POLL
    assert leader._poll() is False and len(added) == rollout_rank.MAX_MESSAGES_PER_POLL + 10  # nothing lost
