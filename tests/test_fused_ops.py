"""The rollout's fused kernels (hexrl/model/ops.py): the torch path against float64 references on CPU,
FlashInfer against the torch path on a GPU (`-m gpu`), and the CPU proxy for the decode step's cost:
weight GEMMs per layer (at most 4; the split layout takes 7)."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hexrl.model import ops
from hexrl.model.attention import CausalAttention
from hexrl.model.config import ModelConfig
from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.rotary import Rotary
from hexrl.model.tiny import make_tiny_model, tiny_config
from hexrl.rollout import Engine, EngineConfig, Request

G = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=G).to(device=device, dtype=dtype)


def ref_rms_norm(x, w, eps):
    x, w = x.double(), w.double()
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_rope(x, positions, inv_freq):
    """Rotate halves of each [.., D] head by angle position * inv_freq (the fp32 product, as HF computes
    it: at position 4095 it is 2e-4 off the exact angle), the rest in float64."""
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_torch_norms_and_silu_match_float64():
    x, r, w = rand(7, 48), rand(7, 48), rand(48)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).double(), ref_rms_norm(x, w, 1e-6), atol=1e-5, rtol=0)
    normed, res = ops.add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    torch.testing.assert_close(res, x + r, atol=0, rtol=0)
    torch.testing.assert_close(normed.double(), ref_rms_norm(x.double() + r.double(), w, 1e-6), atol=1e-5, rtol=0)
    gu = rand(5, 2 * 24)
    want = F.silu(gu[:, :24].double()) * gu[:, 24:].double()
    torch.testing.assert_close(ops.silu_and_mul(gu).double(), want, atol=1e-6, rtol=0)


def test_torch_rope_on_fused_qkv_views_matches_float64():
    cfg = ModelConfig.from_hf(tiny_config(heads=4, kv_heads=2, hidden=64))
    rotary, d = Rotary(cfg), cfg.head_dim
    t, positions = 6, torch.tensor([0, 1, 7, 300, 4095, 2])
    qkv = rand(t, (4 + 2 + 2) * d)
    q, k, _ = qkv.split([4 * d, 2 * d, 2 * d], dim=-1)  # strided views, as the fused projection gives
    rq, rk = ops.rope(q, k, positions, rotary, d)
    assert rq.shape == (t, 4, d) and rk.shape == (t, 2, d)
    torch.testing.assert_close(rq.double(), ref_rope(q.reshape(t, 4, d), positions, rotary.inv_freq), atol=1e-5, rtol=0)
    torch.testing.assert_close(rk.double(), ref_rope(k.reshape(t, 2, d), positions, rotary.inv_freq), atol=1e-5, rtol=0)
    cache = rotary.cos_sin_cache(torch.device("cpu"))  # FlashInfer's table: cos | sin of position * inv_freq
    assert cache.shape == (cfg.max_position_embeddings, d) and cache.dtype == torch.float32
    ang = (300 * rotary.inv_freq.float()).double()
    torch.testing.assert_close(cache[300].double(), torch.cat([ang.cos(), ang.sin()]), atol=1e-4, rtol=0)


def test_kv_slots_write_each_token_to_its_page_and_offset():
    cache = torch.zeros(6, 2, 4, 2, 8)
    pages, offsets = torch.tensor([3, 0, 3, 5]), torch.tensor([1, 2, 3, 0])
    kv = rand(4, 2 * 2 * 8)
    k, v = (t.view(4, 2, 8) for t in kv.split([16, 16], dim=-1))  # strided views, as qkv's split gives
    slots = ops.KVSlots.of(pages, offsets)
    assert slots.indptr.tolist() == [0, 1, 2, 3, 4] and slots.pages.dtype == torch.int32
    ops.append_kv(cache, k, v, slots)
    want = torch.zeros_like(cache)
    for i, (p, o) in enumerate(zip(pages.tolist(), offsets.tolist())):
        want[p, 0, o], want[p, 1, o] = k[i], v[i]
    assert torch.equal(cache, want)


class WeightGemms(TorchDispatchMode):
    """Counts matrix multiplies one of whose operands is a model weight (strided, or oneDNN-packed)."""

    OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def __init__(self, model, packed=()):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in model.parameters()}
        self.packed = {id(p.packed) for p in packed if p.packed is not None}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in self.OPS and any(not t.is_mkldnn and t.data_ptr() in self.ptrs for t in tensors):
            self.count += 1
        elif "_linear_pointwise" in str(func) and any(id(t) in self.packed for t in tensors):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_step_runs_at_most_four_weight_gemms_per_layer(tmp_path):
    path = make_tiny_model(tmp_path / "m", tie=False)
    split = load_pretrained(path)
    layers = split.cfg.num_hidden_layers
    with WeightGemms(split) as before, torch.no_grad():  # the trainer's layout: q, k, v, o, gate, up, down
        split.logits(split.stage(torch.tensor([5, 6, 7]), torch.tensor([4, 9, 2]), CausalAttention([1, 1, 1])))
    assert (before.count - 1) / layers == 7  # lm_head is the one extra
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64), eos_ids=[])
    for i in range(3):
        engine.add(Request(i, [5 + i] * (3 + i), max_new_tokens=8, temperature=0.0))
    engine.step()  # prefill; the next step decodes all three
    decoded = engine.stats.generated_tokens
    with WeightGemms(engine.model, engine.packed) as during:
        engine.step()
    assert engine.stats.generated_tokens - decoded == 3 and engine.stats.mixed_steps == 1
    assert (during.count - 1) / layers <= 4
    assert during.count == 4 * layers + 1  # qkv, o, gate_up, down; lm_head


def test_requests_past_the_rope_table_are_refused(tmp_path):
    engine = Engine(load_pretrained(make_tiny_model(tmp_path / "m")), EngineConfig(page_size=16, max_pages=512))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.add(Request("long", [5] * 100, max_new_tokens=4096 - 99, temperature=0.0))
    engine.add(Request("fits", [5] * 100, max_new_tokens=4096 - 100, temperature=0.0))


class FakeFlashInfer:
    """FlashInfer's five calls as documented (and as their kernels index), in torch, with the argument
    checks their C++ side makes: exercises our call sites on CPU (in-place aliasing, argument order,
    the one-page-per-token KV append), counting calls."""

    def __init__(self):
        self.calls = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def rmsnorm(self, x, w, eps):
        self._count("rmsnorm")
        assert x.dim() == 2 and x.is_contiguous()
        return ref_rms_norm(x, w, eps).to(x.dtype)

    def fused_add_rmsnorm(self, x, residual, w, eps):
        self._count("fused_add_rmsnorm")
        assert x.is_contiguous() and residual.is_contiguous() and x.data_ptr() != residual.data_ptr()
        residual.add_(x)
        x.copy_(ref_rms_norm(residual, w, eps))

    def silu_and_mul(self, x):
        self._count("silu_and_mul")
        if x.shape[-1] * x.element_size() % 16:  # activation.py's check (its kernel loads 16-byte vectors)
            raise ValueError("The pointers must be multiple of 16 bytes.")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    @staticmethod
    def _dispatch_head_dim(head_dim):  # DISPATCH_HEAD_DIM in include/flashinfer/utils.cuh (0.5.3)
        if head_dim not in (64, 128, 256, 512):
            raise RuntimeError(f"Unsupported head_dim: {head_dim}")

    def apply_rope_with_cos_sin_cache_inplace(self, positions, query, key, head_size, cache, is_neox=True):
        self._count("rope")
        self._dispatch_head_dim(head_size)
        assert is_neox and cache.dtype == torch.float32 and cache.is_contiguous() and positions.is_contiguous()
        half = cache.shape[1] // 2
        cos, sin = cache[positions, None, :half], cache[positions, None, half:]
        for x in (query, key):
            assert x.stride(-1) == 1
            h = x.view(x.shape[0], -1, head_size)
            x1, x2 = h[..., :half].clone(), h[..., half:].clone()
            h[..., :half], h[..., half:] = x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def append_paged_kv_cache(self, k, v, batch_indices, positions, cache, indices, indptr, last_page_len,
                              kv_layout="NHD"):
        self._count("append")
        self._dispatch_head_dim(k.shape[-1])
        ints = (batch_indices, positions, indices, indptr, last_page_len)
        assert kv_layout == "NHD" and all(t.dtype == torch.int32 and t.is_contiguous() for t in ints)
        assert len(indptr) == len(last_page_len) + 1 and len(batch_indices) == len(positions) == k.shape[0]
        page_size = cache.shape[2]
        for i, (b, pos) in enumerate(zip(batch_indices.tolist(), positions.tolist())):
            page = indices[indptr[b] + pos // page_size]  # the kernel: indptr[b] * page_size + pos, divmod
            cache[page, 0, pos % page_size], cache[page, 1, pos % page_size] = k[i], v[i]


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = FakeFlashInfer()
    monkeypatch.setattr(ops, "_flashinfer", lambda: fake)
    monkeypatch.setattr(ops, "kernel_tensor", lambda x: ops.FLASHINFER and not torch.is_grad_enabled())
    return fake


HD64 = dict(hidden=256, heads=4, kv_heads=2, intermediate=128)  # head_dim 64: one FlashInfer dispatches


def test_the_flashinfer_call_sites_against_a_fake_with_its_semantics(fake_flashinfer, tmp_path):
    path = make_tiny_model(tmp_path / "m", tie=False, **HD64)
    model = load_pretrained(path, fused=True)
    ids = torch.randint(3, 64, (2, 7), generator=G)
    with torch.no_grad():
        want = load_pretrained(path)(ids)
        got = model(ids)
    layers = model.cfg.num_hidden_layers
    assert fake_flashinfer.calls == {"rmsnorm": 1, "fused_add_rmsnorm": 2 * layers, "rope": layers,
                                     "silu_and_mul": layers}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    cache = torch.zeros(6, 2, 4, 2, 64)
    pages, offsets = torch.tensor([3, 0, 3, 5]), torch.tensor([1, 2, 3, 0])
    k, v = rand(4, 2, 64), rand(4, 2, 64)
    with torch.no_grad():
        ops.append_kv(cache, k, v, ops.KVSlots.of(pages, offsets))
    assert fake_flashinfer.calls["append"] == 1
    want_cache = torch.zeros_like(cache)
    ops.write_kv(want_cache, pages, offsets, k, v)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 96, 128, 256, 512])
def test_head_dims_flashinfer_raises_on_take_the_torch_path_at_every_call_site(fake_flashinfer, head_dim):
    """The one dispatch rule (ops.HEAD_DIMS): RoPE and the KV append (the fake raises as DISPATCH_HEAD_DIM
    does) and the attention backend go to FlashInfer only for 64/128/256; norms have no head dim; SiLU
    needs 16-byte rows. The tiny model's 16 and warm_start's 32 fall back instead of crashing."""
    from hexrl.rollout.flashinfer_backend import flashinfer_problem

    t, d = 3, head_dim
    positions = torch.tensor([0, 5, 9])
    rotary = Rotary(ModelConfig.from_hf(tiny_config(heads=2, kv_heads=1, hidden=2 * d)))
    q, k = rand(t, 2 * d), rand(t, d)
    cache = torch.zeros(4, 2, 4, 1, d)
    with torch.no_grad():
        ops.rope(q, k, positions, rotary, d)
        ops.append_kv(cache, k.view(t, 1, d), k.view(t, 1, d), ops.KVSlots.of(torch.tensor([0, 1, 3]), positions % 4))
    dispatched = d in (64, 128, 256)
    assert fake_flashinfer.calls.get("rope", 0) == fake_flashinfer.calls.get("append", 0) == int(dispatched)
    assert (ops.head_dim_problem(d) is None) == dispatched
    if not dispatched:  # the backend refuses before importing flashinfer: torch paged attention, no graphs
        problem = flashinfer_problem(torch.device("cuda"), torch.bfloat16, d)
        assert f"head_dim {d} is not one FlashInfer dispatches" in problem


def test_silu_and_mul_rows_flashinfer_cannot_load_take_the_torch_path(fake_flashinfer):
    with torch.no_grad():
        for width, called in ((12, 0), (8, 1)):  # 12 bf16 = 24 bytes per half: not a 16-byte multiple
            x = rand(3, 2 * width).bfloat16()
            ops.silu_and_mul(x)
            assert fake_flashinfer.calls.get("silu_and_mul", 0) == called, width


def test_greedy_engine_tokens_are_the_same_with_the_fake_kernels(fake_flashinfer, tmp_path):
    path = make_tiny_model(tmp_path / "m", tie=False, **HD64)
    reqs = [Request(i, [5 + i] * (2 + 3 * i), max_new_tokens=6, temperature=0.0, ignore_eos=True) for i in range(3)]
    outs, cfg = [], EngineConfig(page_size=4, max_pages=64)
    for on in (True, False):
        ops.FLASHINFER = on
        try:
            outs.append(Engine(load_pretrained(path), cfg, eos_ids=[]).generate(reqs))
        finally:
            ops.FLASHINFER = True
    assert fake_flashinfer.calls["rope"] > 0
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    torch.testing.assert_close(torch.tensor([o.logprobs for o in outs[0]]), torch.tensor([o.logprobs for o in outs[1]]),
                               atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- GPU: FlashInfer vs torch

DEV = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.fixture
def flashinfer():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fi = pytest.importorskip("flashinfer")
    assert ops.use_flashinfer(torch.empty(1, device=DEV, dtype=BF16)) is False  # autograd on: torch path
    with torch.no_grad():
        assert ops.use_flashinfer(torch.empty(1, device=DEV, dtype=BF16))
        yield fi


def both(fn):
    """fn() with FlashInfer's kernels, then with ops.FLASHINFER off (the torch path)."""
    fast = fn()
    ops.FLASHINFER = False
    try:
        return fast, fn()
    finally:
        ops.FLASHINFER = True


@pytest.mark.gpu
def test_gpu_rmsnorm_and_fused_add_rmsnorm_equal_torch(flashinfer):
    x, r, w = rand(33, 1536, dtype=BF16, device=DEV), rand(33, 1536, dtype=BF16, device=DEV), rand(1536, dtype=BF16,
                                                                                                   device=DEV)
    fast, slow = both(lambda: ops.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(fast.float(), slow.float(), atol=3e-2, rtol=2e-2)
    (fn, fr), (sn, sr) = both(lambda: ops.add_rms_norm(x.clone(), r.clone(), w, 1e-6))
    torch.testing.assert_close(fr, sr, atol=0, rtol=0)  # the residual sum rounds to bf16 alike
    torch.testing.assert_close(fn.float(), sn.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_silu_and_mul_equals_torch(flashinfer):
    x = rand(17, 2 * 8960, dtype=BF16, device=DEV)
    fast, slow = both(lambda: ops.silu_and_mul(x))
    torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_rope_in_place_on_qkv_views_equals_torch(flashinfer):
    cfg = ModelConfig.from_hf(tiny_config(heads=12, kv_heads=2, hidden=1536))
    rotary, d = Rotary(cfg).to(DEV), cfg.head_dim
    positions = torch.tensor([0, 1, 5, 77, 1023, 4000, 4095], device=DEV)
    qkv = rand(7, (12 + 4) * d, dtype=BF16, device=DEV)

    def run():
        q, k, _ = qkv.clone().split([12 * d, 2 * d, 2 * d], dim=-1)
        rotary.reset()
        return ops.rope(q, k, positions, rotary, d)

    (fq, fk), (sq, sk) = both(run)
    torch.testing.assert_close(fq.float(), sq.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(fk.float(), sk.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_append_paged_kv_cache_equals_the_torch_write(flashinfer):
    pages, offsets = torch.tensor([3, 0, 3, 5, 2], device=DEV), torch.tensor([1, 15, 3, 0, 7], device=DEV)
    kv = rand(5, 2 * 2 * 128, dtype=BF16, device=DEV)
    k, v = (t.view(5, 2, 128) for t in kv.split([256, 256], dim=-1))  # strided, as from the fused qkv

    def run():
        cache = torch.zeros(7, 2, 16, 2, 128, dtype=BF16, device=DEV)
        ops.append_kv(cache, k, v, ops.KVSlots.of(pages, offsets))
        return cache

    fast, slow = both(run)
    assert torch.equal(fast, slow) and fast.abs().sum() > 0


@pytest.mark.gpu
def test_gpu_fused_model_with_flashinfer_kernels_equals_torch_ops(flashinfer, tmp_path):
    """The whole fused forward (bf16): FlashInfer norms, RoPE, SiLU against the same model on torch ops."""
    path = make_tiny_model(tmp_path / "m", vocab=512, hidden=512, heads=8, kv_heads=2, intermediate=1024, tie=False)
    model = load_pretrained(path, dtype=BF16, device=DEV, fused=True)
    ids = torch.randint(3, 512, (2, 50), generator=G).to(DEV)
    fast, slow = both(lambda: model(ids).float())
    scale = slow.abs().max()
    assert (fast - slow).abs().max() < 0.05 * scale
    split = load_pretrained(path, dtype=BF16, device=DEV)  # the trainer's layout and ops (torch, split GEMMs)
    assert (fast - split(ids).float()).abs().max() < 0.05 * scale
