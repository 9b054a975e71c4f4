"""Triton sampling and log-prob kernels against their torch references (TRITON_INTERPRET=1 on CPU)."""

import math
import statistics

import pytest
import torch

import kernels.logprob as logprob_mod
import kernels.sampling as sampling_mod
from kernels import sample, sample_torch, sampling_probs, token_logprobs
from kernels.logprob import TokenLogprobs
from kernels.sampling import sample_triton


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper critical value of chi-square(df): scipy if installed, else Wilson-Hilferty."""
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(1 - alpha, df))
    except ImportError:
        z = statistics.NormalDist().inv_cdf(1 - alpha)
        h = 2.0 / (9.0 * df)
        return df * (1 - h + z * math.sqrt(h)) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, pooling bins whose expected count is < 5."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def kept_by_hand(row: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """Independent plain-Python top-k then top-p (ties at a threshold kept)."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept = order
    if 0 < top_k < len(row):
        kept = [i for i in order if row[i] >= row[order[top_k - 1]]]
    if top_p < 1.0:
        w = [math.exp((row[i] - row[kept[0]]) / temperature) for i in kept]
        total, cum = sum(w), 0.0
        for n, wi in enumerate(w):
            cum += wi / total
            if cum >= top_p:
                kept = [i for i in kept if row[i] >= row[kept[n]]]
                break
    return set(kept)


def row_logits(vocab: int, seed: int = 0, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.8, top_k=12, top_p=0.8),
]


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampling_matches_distribution_chi_square(kw):
    draws, vocab = 16384, 32
    logits = row_logits(vocab).expand(draws, vocab)  # one row, many per-row seeds (stride 0 rows)
    seeds = torch.arange(draws) * 7919 + 11
    tokens, logprobs = sample_triton(logits, seed=seeds, offset=3, **kw)
    probs = sampling_probs(logits[:1], kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))[0]
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0, "sampled a token outside the kept set"
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    torch.testing.assert_close(logprobs.double(), probs.log()[tokens], atol=1e-5, rtol=0)
    ref_tokens, ref_logprobs = sample_torch(logits, seed=seeds, offset=3, **kw)
    assert (tokens == ref_tokens).double().mean() > 0.999  # same Philox noise, same draws
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)


def test_kept_set_semantics_small_cases():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    cases = [(0, 0.6, {0, 1}), (0, 0.75, {0, 1, 2}), (2, 1.0, {0, 1}), (3, 0.8, {0, 1, 2}), (3, 0.75, {0, 1})]
    for k, p, want in cases:
        probs = sampling_probs(logits, 1.0, k, p)[0]
        assert set(torch.nonzero(probs).flatten().tolist()) == want, (k, p)
        toks, _ = sample_triton(logits.expand(256, 4), 1.0, k, p, seed=torch.arange(256))
        assert set(toks.tolist()) == want, (k, p)
    ties = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # both tokens at the top-1 threshold are kept
    toks, lps = sample_triton(ties.expand(256, 4), 1.0, 1, 1.0, seed=torch.arange(256))
    assert set(toks.tolist()) == {0, 1}
    torch.testing.assert_close(lps, torch.full((256,), math.log(0.5)))


def test_reference_kept_set_matches_plain_python():
    for seed in range(6):
        row = row_logits(32, seed, scale=2.0)
        for temperature, k, p in [(1.0, 7, 1.0), (0.6, 0, 0.85), (1.3, 10, 0.7), (1.0, 3, 0.99)]:
            probs = sampling_probs(row[None], temperature, k, p)[0]
            got = set(torch.nonzero(probs).flatten().tolist())
            assert got == kept_by_hand(row.tolist(), temperature, k, p), (seed, temperature, k, p)


def mixed_batch(n: int, vocab: int, seed: int = 1):
    """Rows mixing greedy, plain, top-k and top-p sampling, with their seeds and offsets."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    temp = torch.rand(n, generator=g) + 0.3
    temp[::7] = 0.0
    top_k = torch.randint(0, 30, (n,), generator=g) * (torch.arange(n) % 2)
    top_p = torch.where(torch.arange(n) % 3 == 0, 1.0, torch.rand(n, generator=g) * 0.9 + 0.05)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    offsets = torch.randint(0, 2**40, (n,), generator=g)
    return logits, temp, top_k, top_p, seeds, offsets


def test_mixed_batch_several_blocks_matches_reference(monkeypatch):
    monkeypatch.setattr(sampling_mod, "CPU_MAX_BLOCK", 64)  # V=200: 4 blocks, the last partial
    logits, temp, top_k, top_p, seeds, offsets = mixed_batch(48, 200)
    logits[5, 100:] = -torch.inf  # masked vocabulary entries are never drawn
    tokens, logprobs = sample_triton(logits, temp, top_k, top_p, seeds, offsets)
    ref_tokens, ref_logprobs = sample_torch(logits, temp, top_k, top_p, seeds, offsets)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    probs = sampling_probs(logits, temp, top_k, top_p)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
    sampled = temp > 0  # greedy rows report the T=1 log-prob instead (checked below)
    want = probs.gather(1, tokens[:, None])[:, 0].log()
    torch.testing.assert_close(logprobs[sampled].double(), want[sampled], atol=1e-5, rtol=0)
    assert tokens[5] < 100


def test_greedy_is_argmax_with_full_softmax_logprob():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(2)) * 4
    tokens, logprobs = sample_triton(logits, 0.0, top_k=3, top_p=0.5, seed=5)  # filters ignored
    assert torch.equal(tokens, logits.argmax(dim=-1))
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), want, atol=1e-5, rtol=0)


def test_determinism_offsets_and_batch_independence():
    logits = torch.zeros(512, 64)  # uniform: any two independent draws rarely agree
    seeds = torch.arange(512) + 100
    a, _ = sample_triton(logits, 1.0, seed=seeds, offset=9)
    b, _ = sample_triton(logits, 1.0, seed=seeds, offset=9)
    c, _ = sample_triton(logits, 1.0, seed=seeds, offset=10)
    assert torch.equal(a, b)
    assert (a != c).double().mean() > 0.9
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(0))[:100]
    d, _ = sample_triton(logits[perm], 1.0, seed=seeds[perm], offset=9)
    assert torch.equal(d, a[perm])  # per-row seeds: a row's draw ignores the rest of the batch
    e, _ = sample_triton(logits, 1.0, seed=100, offset=9)  # int seed: rows use different streams
    assert e.unique().numel() > 32


def test_dispatcher_uses_torch_on_cpu_without_interpreter(monkeypatch):
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    got = sample(logits, 0.9, top_k=10, seed=torch.arange(8), offset=2)
    want = sample_torch(logits, 0.9, top_k=10, seed=torch.arange(8), offset=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sampling_arguments_are_validated_all_at_once():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError) as err:
        sample(logits, torch.tensor([1.0, -1.0, 1.0, 1.0]), top_k=-1, top_p=1.5, seed=0, offset=-3)
    for field in ("temperature", "top_k", "top_p", "offset"):
        assert field in str(err.value)
    sample(logits, 1.0, top_k=-1, seed=0, check=False)  # hot loops skip the device-side value checks
    with pytest.raises(ValueError, match="top_p: expected a scalar or shape"):
        sample(logits, 1.0, top_p=torch.ones(3))
    with pytest.raises(ValueError, match="logits"):
        sample(torch.randn(10), 1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_float64_reference(monkeypatch, temperature):
    monkeypatch.setattr(logprob_mod, "CPU_MAX_BLOCK", 128)  # V=1000: 8 blocks, the last partial
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 17, 1000, generator=g) * 4
    targets = torch.randint(0, 1000, (3, 17), generator=g)
    got = token_logprobs(logits, targets, temperature)
    want = torch.log_softmax(logits.double() / temperature, -1).gather(-1, targets[..., None])[..., 0]
    assert got.dtype == torch.float32 and got.shape == (3, 17)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    half = token_logprobs(logits.bfloat16(), targets, temperature)
    want_half = torch.log_softmax(logits.bfloat16().double() / temperature, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(half.double(), want_half, atol=1e-5, rtol=0)


def test_token_logprobs_gradcheck_float64_torch_path():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 13, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (6,), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.8), (logits,))


def test_token_logprobs_triton_grad_matches_torch(monkeypatch):
    monkeypatch.setattr(logprob_mod, "CPU_MAX_BLOCK", 64)
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(40, 300, generator=g) * 3
    targets = torch.randint(0, 300, (40,), generator=g)
    weights = torch.randn(40, generator=g)
    x_tri = logits.clone().requires_grad_()
    out = TokenLogprobs.apply(x_tri, targets, 0.7, True)
    (out * weights).sum().backward()
    x_ref = logits.double().requires_grad_()
    ref = torch.log_softmax(x_ref / 0.7, -1).gather(1, targets[:, None])[:, 0]
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(x_tri.grad.double(), x_ref.grad, atol=1e-5, rtol=0)
    x_bf = logits.bfloat16().requires_grad_()  # the trainer's dtype: grad comes back in bf16
    token_logprobs(x_bf, targets, 0.7).sum().backward()
    assert x_bf.grad.dtype == torch.bfloat16 and bool(torch.isfinite(x_bf.grad.float()).all())


def test_token_logprobs_arguments_are_validated():
    with pytest.raises(ValueError) as err:
        token_logprobs(torch.randn(4, 10), torch.tensor([0, 1, 2, 10]), temperature=0.0)
    assert "targets" in str(err.value) and "temperature" in str(err.value)
    with pytest.raises(ValueError, match="does not match"):
        token_logprobs(torch.randn(4, 10), torch.zeros(3, dtype=torch.long))


@pytest.mark.gpu
def test_gpu_full_vocab_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab, n = 151936, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, vocab, device="cuda", generator=g) * 3).bfloat16()
    temp = torch.rand(n, device="cuda", generator=g) + 0.3
    temp[::9] = 0.0
    top_k = torch.where(torch.arange(n, device="cuda") % 2 == 0, 50, 0)
    top_p = torch.where(torch.arange(n, device="cuda") % 3 == 0, 1.0, 0.9)
    seeds = torch.arange(n, device="cuda") * 31 + 7
    tokens, logprobs = sample(logits, temp, top_k, top_p, seeds, 5)
    ref_tokens, ref_logprobs = sample_torch(logits, temp, top_k, top_p, seeds, 5)
    assert (tokens == ref_tokens).double().mean() > 0.95  # GPU exp/log may differ in the last ulp
    same = tokens == ref_tokens
    torch.testing.assert_close(logprobs[same], ref_logprobs[same], atol=1e-4, rtol=0)
    probs = sampling_probs(logits, temp, top_k, top_p)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
    greedy = temp == 0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(-1))
    # chi-square on a top-k=40 row, many draws in one call
    draws = 16384
    row = logits[1:2].float().expand(draws, vocab)
    toks, _ = sample(row, 1.0, 40, 1.0, torch.arange(draws, device="cuda"), 0)
    probs = sampling_probs(logits[1:2], 1.0, 40, 1.0)[0].cpu()
    counts = torch.bincount(toks.cpu(), minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df)
    # log-probs, forward and backward, at full vocabulary
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    x = logits.float().requires_grad_()
    out = token_logprobs(x, targets, 0.9)
    want = torch.log_softmax(logits.double() / 0.9, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    out.sum().backward()
    ref_grad = torch.autograd.grad(torch.log_softmax(x / 0.9, -1).gather(1, targets[:, None]).sum(), x)[0]
    torch.testing.assert_close(x.grad, ref_grad, atol=1e-6, rtol=1e-4)
