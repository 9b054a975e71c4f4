"""The split-vocabulary sampling kernel (TRITON_INTERPRET=1 on CPU) against the float64 distribution,
the sort-based reference and the one-program-per-row kernel: same kept sets, same (seed, i) draws."""
import pytest
import torch
from test_kernels import chi2_critical, chi2_statistic, kept_by_hand, mixed_batch, row_logits

import kernels.sampling_split as split
from kernels import sample_torch, sampling_probs
from kernels.sampling import sample_triton
from kernels.sampling_split import sample_split, sample_split_rows


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(split, "CPU_CHUNK", 64)  # several chunks per row, the last one partial


def test_mixed_batch_matches_the_reference_and_the_row_kernel(small_chunks):
    args = mixed_batch(24, 200)
    args[0][5, 100:] = -torch.inf  # masked vocabulary entries are never drawn
    tokens, logprobs = sample_split(*args)
    ref_tokens, ref_logprobs = sample_torch(*args)
    assert torch.equal(tokens, ref_tokens)  # same Philox (seed, offset) noise, same kept sets
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    assert torch.equal(tokens, sample_triton(*args)[0])
    probs = sampling_probs(*args[:4])
    assert bool((probs.gather(1, tokens[:, None]) > 0).all()) and tokens[5] < 100
    sampled = args[1] > 0  # greedy rows report the T=1 log-prob
    want = probs.gather(1, tokens[:, None])[:, 0].log()
    torch.testing.assert_close(logprobs[sampled].double(), want[sampled], atol=1e-5, rtol=0)
    # no filtering anywhere: the two-launch path, with and without the caller's promise
    for filtered in (None, False):
        got = sample_split(args[0], 0.8, 0, 1.0, args[4], args[5], filtered=filtered)
        want_t, want_lp = sample_torch(args[0], 0.8, 0, 1.0, args[4], args[5])
        assert torch.equal(got[0], want_t)
        torch.testing.assert_close(got[1], want_lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k,p", [(5, 1.0), (12, 0.8), (0, 0.6)])
def test_kept_sets_equal_the_float64_masks(small_chunks, k, p):
    """Many draws of one row: the tokens drawn are exactly the kept set of an independent
    plain-Python top-k/top-p (every kept token likely enough to be drawn is drawn)."""
    draws, vocab = 512, 100
    row = row_logits(vocab, seed=4, scale=1.0)
    toks, lps = sample_split(row.expand(draws, vocab), 1.0, k, p, seed=torch.arange(draws), offset=1)
    want = kept_by_hand(row.tolist(), 1.0, k, p)
    probs = sampling_probs(row[None], 1.0, k, p)[0]
    assert set(torch.nonzero(probs).flatten().tolist()) == want
    likely = {int(i) for i in torch.nonzero(probs * draws > 12).flatten()}  # P(never drawn) < 1e-5 each
    assert likely <= set(toks.tolist()) <= want and len(likely) >= 4
    torch.testing.assert_close(lps.double(), probs.log()[toks], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=0.8, top_k=12, top_p=0.8)], ids=str)
def test_histogram_agrees_with_the_float64_distribution(monkeypatch, kw):
    monkeypatch.setattr(split, "CPU_CHUNK", 16)  # 32 tokens in 2 chunks
    draws, vocab = 4096, 32
    logits = row_logits(vocab).expand(draws, vocab)
    tokens, _ = sample_split(logits, seed=torch.arange(draws) * 7919 + 11, offset=3, **kw)
    probs = sampling_probs(logits[:1], kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))[0]
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0, "sampled a token outside the kept set"
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"


def test_a_rows_draw_depends_only_on_its_seed_and_offset(small_chunks):
    logits = torch.zeros(64, 150)  # uniform: independent draws rarely agree
    seeds = torch.arange(64) + 100
    a, _ = sample_split(logits, 1.0, 0, 0.9, seeds, 9)
    b, _ = sample_split(logits, 1.0, 0, 0.9, seeds, 9)
    c, _ = sample_split(logits, 1.0, 0, 0.9, seeds, 10)
    assert torch.equal(a, b) and (a != c).double().mean() > 0.9
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:20]
    d, _ = sample_split(logits[perm], 1.0, 0, 0.9, seeds[perm], 9)
    assert torch.equal(d, a[perm])


def test_greedy_rows_are_the_argmax(small_chunks):
    logits = torch.randn(16, 150, generator=torch.Generator().manual_seed(2)) * 4
    tokens, logprobs = sample_split(logits, 0.0, top_k=3, top_p=0.5, seed=5)  # filters ignored
    assert torch.equal(tokens, logits.argmax(dim=-1))
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), want, atol=1e-5, rtol=0)


def test_candidates_serve_peaked_rows_and_the_rest_fall_back(monkeypatch, small_chunks):
    """Rows whose kept set lies within BAND of the max (peaked, as LLM logits) are served by the
    per-chunk candidates alone; flat rows overflow the candidate slots and take the full search.
    Both give the reference's tokens exactly."""
    monkeypatch.setattr(split, "CPU_CAND", 8)  # 8 slots per 64-logit chunk
    g = torch.Generator().manual_seed(5)
    n, vocab = 16, 200
    logits = torch.randn(n, vocab, generator=g) * 3  # flat: most logits within BAND of the max
    peaked = torch.arange(n) % 2 == 0
    top = torch.randint(0, vocab, (n, 6), generator=g)
    logits[peaked] = torch.randn(int(peaked.sum()), vocab, generator=g) - 30.0
    logits[peaked] = logits[peaked].scatter(1, top[peaked], torch.rand(int(peaked.sum()), 6, generator=g) * 4)
    temp = torch.full((n,), 0.9)
    top_k = torch.where(torch.arange(n) % 4 < 2, 3, 0)
    top_p = torch.where(torch.arange(n) % 4 < 2, 1.0, 0.8)
    seeds = torch.arange(n) * 13 + 1
    tokens, logprobs, fast = sample_split_rows(logits, temp, top_k, top_p, seeds, 4)
    assert fast.bool().tolist() == peaked.tolist()
    ref_tokens, ref_logprobs = sample_torch(logits, temp, top_k, top_p, seeds, 4)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    # the candidates' own Gumbel draw: same tokens over many seeds of one peaked row
    row = logits[0].expand(512, vocab)
    toks, _, fast = sample_split_rows(row, 0.9, 3, 1.0, torch.arange(512), 2)
    assert bool(fast.all()) and torch.equal(toks, sample_torch(row, 0.9, 3, 1.0, torch.arange(512), 2)[0])
    assert len(set(toks.tolist())) == 3


@pytest.mark.gpu
def test_gpu_split_kernel_matches_the_row_kernel_at_full_vocab():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = [a.cuda() for a in mixed_batch(64, 151936, seed=3)]
    args[0] = args[0].bfloat16()
    tokens, logprobs = sample_split(*args)
    row_tokens, row_logprobs = sample_triton(*args)
    assert (tokens == row_tokens).double().mean() > 0.98  # sum orders differ: last-ulp near-ties only
    same = tokens == row_tokens
    torch.testing.assert_close(logprobs[same], row_logprobs[same], atol=1e-4, rtol=0)
    probs = sampling_probs(*args[:4])
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
    draws = 16384
    row = args[0][1:2].float().expand(draws, -1)
    toks, _ = sample_split(row, 1.0, 40, 0.95, torch.arange(draws, device="cuda"), 0)
    probs = sampling_probs(args[0][1:2], 1.0, 40, 0.95)[0].cpu()
    counts = torch.bincount(toks.cpu(), minlength=151936).double()
    assert counts[probs == 0].sum() == 0
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df)
    # LLM-like peaked rows: the candidates serve top-k / top-p at full vocabulary
    g = torch.Generator(device="cuda").manual_seed(4)
    peaked = torch.randn(64, 151936, device="cuda", generator=g) * 2 - 12.0
    lead = torch.randint(0, 151936, (64, 64), device="cuda", generator=g)
    peaked = peaked.scatter(1, lead, torch.rand(64, 64, device="cuda", generator=g) * 8)
    k = torch.where(torch.arange(64, device="cuda") % 2 == 0, 50, 0)
    p = torch.where(torch.arange(64, device="cuda") % 2 == 0, 1.0, 0.9)
    seeds = torch.arange(64, device="cuda")
    tokens, logprobs, fast = sample_split_rows(peaked, 0.8, k, p, seeds, 3)
    assert bool(fast.bool().all())
    ref_tokens, ref_logprobs = sample_torch(peaked, 0.8, k, p, seeds, 3)
    assert (tokens == ref_tokens).double().mean() > 0.98
    same = tokens == ref_tokens
    torch.testing.assert_close(logprobs[same], ref_logprobs[same], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_every_split_kernel_compiles_for_sm90_without_a_gpu():
    """tools/device/compile_sm90.py: Triton's compiler (ptxas included) builds every kernel variant the GPU
    will launch, for an H100, here: what the interpreter cannot check (about 20 s)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, str(root / "tools" / "device" / "compile_sm90.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" ok") == 10


def test_one_engine_start_compiles_each_split_kernel_variant_once_not_per_batch_size():
    """With B and `it` unspecialised, the 286 sampler launches of one engine start's graph capture
    (13 sizes x plain and filtered heads) are 10 Triton variants, by Triton's own specialisation rule
    (specialised, there would be one per value class of B and it). The real sm_90 build of those is
    `TRITON_INTERPRET=0 python tools/device/compile_sm90.py --engine-start --compile`."""
    pytest.importorskip("triton.backends.compiler")
    from tools.device import compile_sm90

    variants = compile_sm90.engine_start_compiles(256, 151936)
    assert len(list(compile_sm90.engine_start_launches(256, 151936))) == 286
    assert len(variants) == 10
    names = sorted(k[0] for k in variants)
    assert names.count("_round_kernel") == 4 and names.count("_stats_kernel") == 2  # (PHASE, FIRST); CAND 0/128
