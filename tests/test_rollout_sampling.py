"""The engine's sampling path: greedy steps take an argmax and never the sampling kernel."""
import pytest
import torch

import hexrl.rollout.sampler as sampler
from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sampling") / "m", vocab=128, tie=False)


def requests(temperature: float, n: int = 3) -> list[Request]:
    g = torch.Generator().manual_seed(3)
    return [Request(i, torch.randint(3, 128, (4 + 3 * i,), generator=g).tolist(), max_new_tokens=6,
                    temperature=temperature, seed=i, ignore_eos=True) for i in range(n)]


def test_greedy_never_calls_the_sampling_kernel(tiny, monkeypatch):
    calls, real = [], sampler.sample_tokens

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(sampler, "sample_tokens", counting)
    engine = Engine(load_pretrained(tiny), EngineConfig(page_size=4, max_pages=64), eos_ids=[])
    outs = engine.generate(requests(0.0))
    assert calls == [] and all(len(o.token_ids) == 6 for o in outs)
    # the same greedy tokens and log-probs as the sampler gives greedy rows
    monkeypatch.setattr(sampler, "greedy_tokens", lambda logits: pytest.fail("argmax path used for a sampled step"))
    mixed = requests(0.0) + [Request(9, [5, 6, 7], max_new_tokens=6, temperature=1.0, seed=1, ignore_eos=True)]
    ref = Engine(load_pretrained(tiny), EngineConfig(page_size=4, max_pages=64), eos_ids=[]).generate(mixed)
    assert calls  # the patch is live: a step with a sampled row goes through the sampler
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
