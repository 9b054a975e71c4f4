"""Trainer fast paths: variable-length attention for packed sequences (GPU parity marked `gpu`),
float32 logits from low-precision weights, an optimizer step with no host sync, and the settings
that were removed or made optional."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hexrl.model.attention import CausalAttention, torch_varlen, varlen_function
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.tiny import make_tiny_model, tiny_config
from hexrl.train.optim import AdamW, clip_divisor, global_grad_norm
from hexrl.train.trainer import TrainConfig, Trainer
from hexrl.trajectory import Trajectory

LENS = [5, 1, 9, 3]


def packed(hq=4, hkv=2, d=8, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    return [torch.randn(t, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv)]


def per_sequence_attention(lens, q, k, v):
    """The reference: causal attention computed for each sequence on its own."""
    outs, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        qs, ks, vs = (t[s].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    """A stand-in for torch's varlen_attn (CPU, any dtype), per sequence from the cumulative lengths."""
    causal = kw.get("window_size") == (-1, 0) or kw.get("is_causal", False)
    assert causal and torch.equal(cu_q, cu_k)
    if not kw.get("enable_gqa", False):
        assert q.shape[1] == k.shape[1], "without enable_gqa the adapter must repeat k/v heads"
    lens = (cu_q[1:] - cu_q[:-1]).tolist()
    assert max_q == max_k == max(lens)
    return per_sequence_attention(lens, q, k, v)


@pytest.mark.parametrize("api", ["window_size+gqa", "is_causal"])
def test_varlen_adapter_passes_causal_and_gqa_for_either_torch_api(api):
    if api == "window_size+gqa":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
            return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                                    enable_gqa=enable_gqa)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
            return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal)
    q, k, v = packed()
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    got = torch_varlen(fake)(q, k, v, cu, 9)
    torch.testing.assert_close(got, per_sequence_attention(LENS, q, k, v), atol=0, rtol=0)


def test_cpu_packed_attention_and_its_gradients_match_each_sequence_alone():
    lens = [7, 1, 12, 3, 12, 2]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    got = CausalAttention(lens)(0, q, k, v)  # one SDPA call over the padded batch
    want = per_sequence_attention(lens, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_packed_attention_never_crosses_sequences_on_cpu():
    q, k, v = packed()
    out = CausalAttention(LENS)(0, q, k, v)
    alone = CausalAttention([9])(0, *(t[6:15] for t in (q, k, v)))  # the third sequence by itself
    torch.testing.assert_close(out[6:15], alone, atol=1e-6, rtol=1e-6)


def test_fp32_logits_from_bf16_weights_are_not_rounded_to_bf16():
    cfg = ModelConfig.from_hf(tiny_config(vocab=64, tie=False))
    model = Decoder(cfg)
    model.init_weights(seed=0)
    model.to(torch.bfloat16)
    h = torch.randn(5, cfg.hidden_size).bfloat16()
    got = model.logits(h, fp32=True)
    want = F.linear(h.float(), model.lm_head.weight.float())
    assert got.dtype == torch.float32 and model.logits(h).dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, got.bfloat16().float())  # more precision than bf16 logits carry


def _params_with_grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(6, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]
    grads = [torch.randn(p.shape, generator=g) * 3 for p in params]
    return params, grads


def test_clipping_on_the_device_matches_clip_grad_norm_and_torch_adamw():
    ours, grads = _params_with_grads(0)
    ref, _ = _params_with_grads(0)
    opt = AdamW(ours, lr=1e-2, weight_decay=0.1)
    groups = [{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=1e-2)
    for step in range(3):
        for p, r, g in zip(ours, ref, grads):
            p.main_grad, r.grad = g.clone() * (step + 1), g.clone() * (step + 1)
        norm = global_grad_norm([p.main_grad for p in ours], None, torch.device("cpu"))
        assert norm.dim() == 0  # stays a tensor: nothing waits for the device
        opt.step(clip_divisor(norm, 0.5), skip=~torch.isfinite(norm))
        assert norm.item() == pytest.approx(torch.nn.utils.clip_grad_norm_(ref, 0.5).item(), rel=1e-6)
        torch_opt.step()
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-6)


def test_a_non_finite_gradient_skips_the_update_on_the_device():
    params, grads = _params_with_grads(1)
    opt = AdamW(params, lr=1e-2)
    for p, g in zip(params, grads):
        p.main_grad = g.clone()
    opt.step(clip_divisor(global_grad_norm([p.main_grad for p in params], None, torch.device("cpu")), 1.0))
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.opt.state[p].items()} for p in params]
    params[1].main_grad = grads[1].clone()
    params[1].main_grad[0] = float("inf")
    params[0].main_grad = grads[0].clone()
    norm = global_grad_norm([p.main_grad for p in params], None, torch.device("cpu"))
    opt.step(clip_divisor(norm, 1.0), skip=~torch.isfinite(norm))
    for p, b, st in zip(params, before, state):
        assert torch.equal(p.detach(), b)  # weights, moments and the step count all untouched
        assert all(torch.equal(opt.opt.state[p][k], v) for k, v in st.items())


def test_strided_master_weights_are_refused():
    """torch's fused CPU AdamW updates a strided view wrongly (0.2 off at lr 0.1 in one step)."""
    with pytest.raises(ValueError, match="contiguous"):
        AdamW([torch.nn.Parameter(torch.randn(4, 8)[:, :4])], lr=0.1)


def test_float16_training_is_refused_and_entropy_is_optional():
    assert TrainConfig(dtype="float16").problems() == [
        "train.dtype: float16 training is not supported (no loss scaler); use bfloat16"]
    assert TrainConfig(entropy_metric=False).problems() == []


@pytest.mark.gpu
def test_gpu_varlen_attention_matches_per_sequence():
    if not torch.cuda.is_available() or varlen_function() is None:
        pytest.skip("needs CUDA and torch varlen_attn or flash_attn")
    q, k, v = packed(hq=8, hkv=2, d=64, dtype=torch.bfloat16, device="cuda")
    got = CausalAttention(LENS)(0, q, k, v)
    want = per_sequence_attention(LENS, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_fp32_logits_forward_and_backward():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.from_hf(tiny_config(vocab=64, tie=False))
    model = Decoder(cfg).cuda().to(torch.bfloat16)
    h = torch.randn(5, cfg.hidden_size, device="cuda").bfloat16().requires_grad_()
    out = model.logits(h, fp32=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(h.float(), model.lm_head.weight.float()), atol=1e-3, rtol=1e-3)
    out.sum().backward()
    assert h.grad is not None and model.lm_head.weight.grad is not None


class ScalarReads(TorchDispatchMode):
    """Counts `.item()`-style reads (aten._local_scalar_dense): each one is a host sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.count, self.active = 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.active and func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_no_scalar_from_the_device(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=2)
    trainer = Trainer(path, {"dp": 1, "stages": [{"tp": 1, "layers": [0, 2]}]},
                      TrainConfig(lr=1e-3, ppo_minibatches=2, micro_batch_tokens=16, grad_clip=0.1), device="cpu")
    batch = [Trajectory(i // 2, [1, 2, 3 + i], [4 + i, 5, 6, 7], [-4.0] * 4, [0] * 4, reward=float(i % 2))
             for i in range(6)]
    reads, to_host = ScalarReads(), trainer._to_host

    def one_copy(state):  # the step's device-to-host copy: what follows reads host tensors
        reads.active = False
        return to_host(state)

    trainer._to_host = one_copy
    with reads:
        metrics = trainer.step(batch)
    assert metrics["optimizer_steps"] == 2 and metrics["grad_norm"] > 0.1  # clipping engaged
    assert not reads.active and reads.count == 0  # norm, clipping, skip and sums stay on the device
