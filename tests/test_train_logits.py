"""float32 logits with a backward (Fp32Linear) and the chunked lm_head + log-prob (linear_logprobs):
against float64 references, the unchunked path, a TP=2 gloo world, and the size of the largest
tensor a CPU training step allocates."""
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_world
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.logprob as logprob_kernels
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.fp32_linear import fp32_linear
from hexrl.model.parallel import TPGroup
from hexrl.model.tiny import make_tiny_model, tiny_config
from hexrl.train import TrainConfig, Trainer
from hexrl.train import linear_logprobs as linear_logprobs_mod
from hexrl.train.linear_logprobs import linear_logprobs
from hexrl.train.packing import plan_step
from hexrl.trajectory import Trajectory


def _operands(dtype, n=9, h=16, v=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_()
    c = torch.randn(n, v, generator=g)  # d loss / d logits
    return x, w, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp32_linear_forward_and_grads_match_float64(dtype):
    x, w, c = _operands(dtype)
    y = fp32_linear(x, w)
    assert y.dtype == torch.float32
    (y * c).sum().backward()
    xd, wd = x.detach().double(), w.detach().double()  # the same (rounded) values, exact arithmetic
    cd = c.to(dtype).double()  # the backward GEMMs take d loss / d logits in the weights' dtype
    torch.testing.assert_close(y.double(), xd @ wd.t(), atol=1e-5, rtol=1e-6)
    assert x.grad.dtype == w.grad.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=8e-3)  # one bf16 rounding
    torch.testing.assert_close(x.grad.double(), cd @ wd, **tol)
    torch.testing.assert_close(w.grad.double(), cd.t() @ xd, **tol)


def test_fp32_linear_gradcheck_in_float64():
    x, w, _ = _operands(torch.float64, n=4, h=5, v=6)
    assert torch.autograd.gradcheck(fp32_linear, (x, w))


def test_decoder_fp32_logits_have_a_backward_for_bf16_weights():
    cfg = ModelConfig.from_hf(tiny_config(vocab=64, tie=False))
    model = Decoder(cfg)
    model.init_weights(seed=0)
    model.to(torch.bfloat16)
    h = torch.randn(5, cfg.hidden_size).bfloat16().requires_grad_()
    out = model.logits(h, fp32=True)
    assert out.dtype == torch.float32
    out.pow(2).sum().backward()  # the CUDA branch used to be torch.mm(out_dtype=): no derivative
    want = 2 * out.detach().bfloat16().double() @ model.lm_head.weight.detach().double()
    torch.testing.assert_close(h.grad.double(), want, atol=5e-2, rtol=1e-2)
    assert model.lm_head.weight.grad is not None


def _unchunked(hidden, weight, targets, temperature):
    """What linear_logprobs replaces, by plain autograd: the whole micro-batch's fp32 logits at once.
    (log-probs, entropy)."""
    logp = torch.log_softmax(fp32_linear(hidden, weight) / temperature, -1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1).detach()


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 100])
def test_linear_logprobs_equal_the_unchunked_path(chunk_rows, path, monkeypatch):
    if path == "torch":  # the vocab-parallel helpers with no group, as on a CPU without the interpreter
        monkeypatch.setattr(linear_logprobs_mod, "use_triton", None)
    else:  # the Triton kernels (interpreted on CPU), several vocabulary blocks per row, the last partial
        assert linear_logprobs_mod.use_triton(torch.zeros(1)), "tests/conftest.py sets TRITON_INTERPRET=1"
        monkeypatch.setattr(logprob_kernels, "CPU_MAX_BLOCK", 16)
    g = torch.Generator().manual_seed(3)
    n, h, v = 13, 8, 40
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    got, got_ent = linear_logprobs(hidden, weight, targets, None, 0.7, True, chunk_rows)
    got_grads = torch.autograd.grad((got * coef).sum(), (hidden, weight))
    want, want_ent = _unchunked(hidden, weight, targets, 0.7)
    want_grads = torch.autograd.grad((want * coef).sum(), (hidden, weight))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_linear_logprobs_gradcheck_in_float64_and_bf16_close_to_it():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, 3, 3, 1])
    assert torch.autograd.gradcheck(lambda x, w: linear_logprobs(x, w, targets, None, 1.3, False, 2)[0],
                                    (hidden, weight))
    hb, wb = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    lp, _ = linear_logprobs(hb, wb, targets, None, 1.3, False, 2)
    ref, _ = linear_logprobs(hb.detach().double(), wb.detach().double(), targets, None, 1.3, False, 2)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=1e-5)  # fp32 accumulation: no bf16 logits
    lp.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16


def test_linear_logprobs_frozen_weight_gets_no_gradient_and_hidden_the_same_one():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(6, 4, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, generator=g)  # frozen (a reference model's lm_head)
    targets = torch.tensor([0, 8, 3, 3, 1, 5])
    lp, _ = linear_logprobs(hidden, weight, targets, None, 1.0, False, 4)
    (got,) = torch.autograd.grad(lp.sum(), hidden)
    lp2, _ = linear_logprobs(hidden, weight.clone().requires_grad_(), targets, None, 1.0, False, 4)
    torch.testing.assert_close(got, torch.autograd.grad(lp2.sum(), hidden)[0], atol=0, rtol=0)


class _Outputs(TorchDispatchMode):
    """Records (op name, shape, dtype) of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.seen.append((func.overloadpacket.__name__, tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_the_lm_head_gradient_is_written_once_not_summed_from_per_chunk_partials(path, monkeypatch):
    """The backward's traffic probe: the weight gradient's rows come out of matrix multiplies exactly once
    (V x H elements in all, never a [V, H] float32 partial per chunk added into an accumulator), and no
    logits chunk holds more than the forward's chunk_rows x V elements (here a quarter of [N, V])."""
    if path == "torch":
        monkeypatch.setattr(linear_logprobs_mod, "use_triton", None)
    g = torch.Generator().manual_seed(5)
    n, h, v, chunk_rows = 32, 8, 40, 8
    hidden = torch.randn(n, h, generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.bfloat16, requires_grad=True)
    lp, _ = linear_logprobs(hidden, weight, torch.randint(0, v, (n,), generator=g), None, 0.7, False, chunk_rows)
    with _Outputs() as probe:
        lp.sum().backward()
    mm_out = [shape for op, shape, _ in probe.seen if op in ("mm", "addmm") and shape[-1] == h]
    assert sum(s[0] for s in mm_out if s != (n, h)) == v  # each weight-gradient row computed once
    assert not [x for x in probe.seen if x[1] == (v, h) and x[2] == torch.float32]  # no fp32 [V, H] partial
    biggest = max(s[0] * s[1] for op, s, dt in probe.seen if dt == torch.float32 and len(s) == 2 and s[1] != h)
    assert biggest <= chunk_rows * v <= n * v // 4
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16


def test_linear_logprobs_refuses_bad_shapes():
    with pytest.raises(ValueError, match="hidden"):
        linear_logprobs(torch.randn(3, 4), torch.randn(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), chunk_rows=0)


def _tp_case():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(11, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(20, 6, generator=g, dtype=torch.float64)
    targets = torch.tensor([0, 19, 9, 10, 4, 15, 10, 9, 2, 17, 11])  # both vocab halves and the border
    return hidden, weight, targets, torch.randn(11, generator=g, dtype=torch.float64)


def _tp_worker(rank, world):
    hidden, weight, targets, coef = _tp_case()
    rows = weight.shape[0] // world
    h = hidden.clone().requires_grad_()
    w = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    lp, ent = linear_logprobs(h, w, targets, TPGroup(dist.group.WORLD, rank, world), 0.8, True, 4)
    (lp * coef).sum().backward()
    return lp.detach(), ent, h.grad, w.grad


def test_linear_logprobs_tp2_over_gloo_matches_one_process():
    hidden, weight, targets, coef = _tp_case()
    results = run_world(_tp_worker, 2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_logprobs(h, w, targets, None, 0.8, True, 4)
    (lp * coef).sum().backward()
    half = weight.shape[0] // 2
    for rank, (lp_r, ent_r, h_grad, w_grad) in enumerate(results):
        torch.testing.assert_close(lp_r, lp.detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(ent_r, ent, atol=1e-12, rtol=0)
        torch.testing.assert_close(h_grad, h.grad, atol=1e-12, rtol=0)  # all-reduced over the shards
        torch.testing.assert_close(w_grad, w.grad[rank * half:(rank + 1) * half], atol=1e-12, rtol=0)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op (forward or backward) returns."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.largest:
                self.largest, self.op = t.numel() * t.element_size(), func
        return out


@pytest.mark.parametrize("decoupled", [False, True])
def test_largest_tensor_of_a_training_step_is_a_fraction_of_the_logits(tmp_path, decoupled):
    vocab, hidden = 1024, 32  # a vocabulary much wider than the hidden size, as in real models
    path = make_tiny_model(tmp_path / "m", vocab=vocab, hidden=hidden, layers=1, heads=2, kv_heads=1, intermediate=64)
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=640, logprob_chunk_rows=64, decoupled=decoupled, bucket_mb=0.1)
    trainer = Trainer(path, {"dp": 1, "stages": [{"tp": 1, "layers": [0, 1]}]}, cfg, device="cpu")
    batch = [Trajectory(i // 4, list(range(1 + i, 17 + i)), [(7 * i + 3 * k) % vocab for k in range(64)],
                        [-5.0] * 64, [0] * 64, reward=float(i % 2)) for i in range(16)]
    plans = plan_step(batch, list(range(16)), [1.0] * 16, 1, 1, cfg.micro_batch_tokens)
    completion = max(mb.num_loss_tokens for p in plans for mb in p.micro_batches[0])
    with LargestTensor() as seen:
        trainer.step(batch)
    logits_bytes = completion * vocab * 4  # the micro-batch's float32 logits, which the step used to build
    assert completion >= 4 * 64 and seen.largest <= logits_bytes / 4, (seen.largest, seen.op, logits_bytes)


@pytest.mark.gpu
def test_gpu_linear_logprobs_bf16_track_float64_and_never_upcast_the_weight():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(6)
    n, h, v = 6000, 256, 32768
    hidden = (torch.randn(n, h, generator=g) * 0.5).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, v, (n,), generator=g)
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want, want_ent = linear_logprobs(hd, wd, targets, None, 0.9, True, 4096)
    want.sum().backward()
    hc, wc = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got, got_ent = linear_logprobs(hc, wc, targets.cuda(), None, 0.9, True, 1024)
    got.sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < v * h * 4 + 3 * 1024 * v * 4 < n * v * 4  # an fp32 weight-gradient sum and a chunk's buffers
    torch.testing.assert_close(got.double().cpu(), want.detach(), atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(got_ent.double().cpu(), want_ent, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(hc.grad.double().cpu(), hd.grad, atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(wc.grad.double().cpu(), wd.grad, atol=2e-3, rtol=2e-2)
