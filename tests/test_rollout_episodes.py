"""Episodes in the engine: a turn ends, the sequence waits (holding its KV pages, no decode slot),
an observation is appended and decoding continues from the cached KV. Checked against greedy
single-turn generation of the same context from scratch, with prefilled tokens counted."""
import pytest
import torch

from hexrl.model.hf_checkpoint import load_pretrained, save_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request

VOCAB = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random checkpoint with a sharpened lm_head (greedy picks without near-ties)."""
    path = make_tiny_model(tmp_path_factory.mktemp("episodes") / "m", seed=0, vocab=VOCAB, tie=False)
    model = load_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    save_pretrained(model, path)
    return path


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_episodes(engine: Engine, prompts: dict, observations: dict, turn_tokens: int, on_turn=None) -> dict:
    """Drive greedy episodes to the end: after turn k of episode e, append observations[e][k] (the
    last turn gets none); returns each episode's final token list (prompt, turns, observations)."""
    for e, p in prompts.items():
        engine.add(Request(e, p, max_new_tokens=turn_tokens, temperature=0.0, ignore_eos=True, episode=True))
    seqs, turns = {}, {e: 0 for e in prompts}
    while engine.has_work():
        for out in engine.step():
            e = out.id
            if e not in prompts:  # a single-turn request sharing the batch
                seqs[e] = out.token_ids
                continue
            seqs.setdefault(e, list(prompts[e]))
            seqs[e] += out.token_ids
            if on_turn:
                on_turn(engine, e)
            if turns[e] < len(observations[e]):
                seqs[e] += observations[e][turns[e]]
                engine.extend(e, observations[e][turns[e]], turn_tokens)
                turns[e] += 1
            else:
                engine.release(e)
    return seqs


def greedy_from_scratch(path, context: list[int], n: int) -> list[int]:
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64))
    return engine.generate([Request(0, context, max_new_tokens=n, temperature=0.0, ignore_eos=True)])[0].token_ids


def check_turns(path, prompt: list[int], final: list[int], observations: list[list[int]], turn_tokens: int):
    """Every turn of `final` is what greedy decoding of its context from scratch gives."""
    at = len(prompt)
    for obs in observations + [[]]:
        assert final[at:at + turn_tokens] == greedy_from_scratch(path, final[:at], turn_tokens)
        at += turn_tokens + len(obs)
    assert at == len(final)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_four_turn_episode_prefills_each_token_once(ckpt, overlap):
    prompt, obs, n = ids(7, 0), [ids(3, 1), ids(5, 2), ids(2, 3)], 5
    engine = Engine(load_pretrained(ckpt), EngineConfig(page_size=4, max_pages=64, overlap=overlap))
    final = run_episodes(engine, {"e": prompt}, {"e": obs}, n)["e"]
    check_turns(ckpt, prompt, final, obs, n)
    s = engine.stats
    # model inputs that sample nothing: the prompt and each observation once, less the one input
    # per turn that samples its first token (a turn's last token enters with the next observation);
    # re-prefilling the conversation each turn would make it 6 + 14 + 24 + 31 = 75
    assert s.prefill_tokens == len(prompt) + sum(map(len, obs)) - 1
    assert s.prefill_tokens + s.generated_tokens == len(final) - 1  # every position ran exactly once
    assert s.finished == {"length": 4} and not engine.has_work() and engine.pool.num_free == engine.pool.num_pages


def test_a_waiting_episode_holds_pages_but_no_decode_slot(ckpt):
    """max_running 1: while the episode waits for its observation, another request decodes."""
    engine = Engine(load_pretrained(ckpt), EngineConfig(page_size=4, max_pages=64, max_running=1, overlap=False))
    engine.add(Request("e", ids(6, 0), max_new_tokens=3, temperature=0.0, ignore_eos=True, episode=True))
    out = []
    while not out:
        out = engine.step()
    seq = engine._parked["e"]
    assert seq.slot == -1 and seq.pages and seq in engine.scheduler.holding
    assert not engine.scheduler.running and not engine.has_work()
    other = engine.generate([Request("x", ids(4, 5), max_new_tokens=4, temperature=0.0, ignore_eos=True)])[0]
    assert len(other.token_ids) == 4 and seq.pages  # it ran in the only slot; the episode kept its pages
    with pytest.raises(ValueError, match="not parked"):
        engine.extend("x", [5], 2)
    with pytest.raises(ValueError, match="exceed"):
        engine.extend("e", [5] * 10, engine.max_sequence_tokens)
    engine.extend("e", [5, 6], 2)
    with pytest.raises(ValueError, match="not parked"):
        engine.extend("e", [5], 2)
    assert len(_next_turn(engine)) == 2


def _next_turn(engine):
    while True:
        for out in engine.step():
            return out.token_ids


def test_many_episodes_interleave_under_page_pressure_and_a_weight_update(ckpt):
    """Eight episodes and four single-turn requests share a small pool: parked pages are evicted
    (and recomputed), running ones preempted, and a weight update drops everything mid-way; every
    turn still equals greedy decoding of its context from scratch, and all pages come back."""
    model = load_pretrained(ckpt)
    engine = Engine(model, EngineConfig(page_size=4, max_pages=24, max_running=4, max_batch_tokens=16))
    prompts = {f"e{i}": ids(3 + i, 10 + i) for i in range(8)}
    obs = {e: [ids(1 + (i + k) % 4, 100 * i + k) for k in range(3)] for i, e in enumerate(prompts)}
    for j in range(4):
        engine.add(Request(f"s{j}", ids(5, 50 + j), max_new_tokens=6, temperature=0.0, ignore_eos=True))
    turns = {"n": 0}
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def update_once(engine, e):
        turns["n"] += 1
        if turns["n"] == 9:  # same weights: the outputs must not change, only the KV is recomputed
            engine.update_weights(state, version=1)
    final = run_episodes(engine, prompts, obs, 4, on_turn=update_once)
    for e in prompts:
        check_turns(ckpt, prompts[e], final[e], obs[e], 4)
    for j in range(4):
        assert final[f"s{j}"] == greedy_from_scratch(ckpt, ids(5, 50 + j), 6)
    s = engine.stats
    assert s.interrupts == 1 and s.finished["length"] == 8 * 4 + 4
    assert s.evictions > 0  # pressure was real: waiting episodes gave their pages up
    assert engine.pool.num_free == engine.pool.num_pages and not engine._parked and not engine._live


def test_a_turn_looks_for_its_stop_string_only_in_its_own_tokens(tmp_path):
    """The previous turn ended with the stop string; the next turn must not stop on it again."""
    from hexrl.data.tokenizer import CharTokenizer

    tok = CharTokenizer()
    path = make_tiny_model(tmp_path / "c", seed=3, vocab=tok.vocab_size, tie=False)
    prompt = tok.encode("12+34=")
    free = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64), tokenizer=tok)
    text = tok.decode(free.generate([Request(0, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)])[0]
                      .token_ids)
    stop = text[:2]  # greedy writes it at once
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64), tokenizer=tok)
    engine.add(Request("e", prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_strings=(stop,),
                       episode=True))
    assert tok.decode(_next_turn(engine)) == stop
    engine.extend("e", tok.encode("7"), 12)
    second = tok.decode(_next_turn(engine))
    # the window once reached back into the previous turn, which ends with the stop string: it stopped
    # after one token
    assert len(second) >= 2 and stop not in second[:-1] and (second.endswith(stop) or len(second) == 12)
