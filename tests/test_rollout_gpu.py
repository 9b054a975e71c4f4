"""GPU-only: the FlashInfer backend against the torch paged backend, CUDA-graph decode against eager
(graphs of every size sharing one logits buffer and one int workspace), loud FlashInfer fallback.

Run on a device with `python -m pytest -m gpu tests/test_rollout_gpu.py`.
"""
from pathlib import Path

import pytest
import torch

from hexrl.model.hf_checkpoint import load_pretrained, save_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.attention_meta import build_meta
from hexrl.rollout.pages import PagePool
from hexrl.rollout.torch_paged import TorchPagedAttention

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SHAPES = {"gqa2": dict(heads=4, kv_heads=2, hidden=256), "gqa4-tensor-cores": dict(heads=8, kv_heads=2, hidden=512)}


@pytest.fixture(autouse=True)
def need_flashinfer():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")


def two_pools(hkv, d, page_size, dtype):
    return [PagePool(range(0, 1), 64, page_size, hkv, d, dtype, DEV) for _ in range(2)]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("page_size", [4, 16])
def test_flashinfer_equals_torch_paged(shape, page_size):
    from hexrl.rollout.flashinfer_backend import WORKSPACE_BYTES, FlashInferAttention

    hq, hkv = SHAPES[shape]["heads"], SHAPES[shape]["kv_heads"]
    d, dtype = 64, torch.bfloat16
    fi_pool, ref_pool = two_pools(hkv, d, page_size, dtype)
    fi = FlashInferAttention(fi_pool, hq, hkv, d, torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEV))
    lens = [37, 3, 18, 1]
    tables = [fi_pool.alloc(-(-n // page_size)) for n in lens]
    g = torch.Generator(device=DEV).manual_seed(0)
    # a mixed step (prefill chunks + a decode), then the rest of each sequence, then a pure decode step
    steps = [[(0, 20), (0, 2), (0, 17), (0, 1)], [(20, 16), (2, 1), (17, 1)], [(36, 1), (3, 0), (18, 0)]]
    for split in steps:
        spans = [(t, a, n) for t, (a, n) in zip(tables, split) if n > 0]
        meta = build_meta(spans, page_size, DEV)
        t = meta.num_tokens
        q = torch.randn(t, hq, d, generator=g, device=DEV, dtype=dtype)
        k = torch.randn(t, hkv, d, generator=g, device=DEV, dtype=dtype)
        v = torch.randn(t, hkv, d, generator=g, device=DEV, dtype=dtype)
        out = fi.begin(meta)(0, q, k, v)
        ref = TorchPagedAttention(ref_pool, meta)(0, q, k, v)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fi_pool.kv[0].float(), ref_pool.kv[0].float(), atol=0, rtol=0)


def checkpoint(path: Path, shape: str) -> Path:
    make_tiny_model(path, vocab=512, tie=False, intermediate=512, **SHAPES[shape])
    model = load_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # well-separated greedy picks even in half precision
    save_pretrained(model, path)
    return path


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cuda_graph_decode_equals_eager(tmp_path, shape):
    path = checkpoint(tmp_path / "m", shape)
    cfg = dict(page_size=16, max_pages=256, max_running=12, attention="flashinfer")
    graphed = Engine(load_pretrained(path, dtype=torch.float16, device=DEV), EngineConfig(**cfg, cuda_graphs=True))
    assert graphed.graphs is not None and graphed.graphs.batch_sizes == [1, 2, 4, 8, 12]
    reqs = [Request(i, p, max_new_tokens=20, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts(10))]
    for r in reqs:
        graphed.add(r)
    graphed.step()  # prefill (eager); every sequence now decodes
    chunks = graphed.scheduler.schedule()
    assert all(c.n == 1 for c in chunks) and len(chunks) == 10
    spans = [(c.seq.pages, c.start, 1) for c in chunks]
    ids = torch.tensor([c.seq.tokens[-1] for c in chunks], device=DEV)
    with torch.no_grad():
        meta = build_meta(spans, 16, DEV)
        replayed = graphed.graphs.run(meta, ids).clone()  # padded to 12 rows inside
        assert replayed.dtype == torch.float32  # fp32 logits, in the buffer all sizes share
        assert graphed.graphs.buffers.logits.shape == (12, 512)
        m = graphed.model
        eager = m.logits(m.stage(ids, meta.positions, graphed.backend.begin(meta))).float()
    torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))

    # whole generations: graphs vs eager FlashInfer vs the torch backend, same tokens
    outs = {}
    for name, extra in [("graph", dict(cuda_graphs=True)), ("eager", dict(cuda_graphs=False)),
                        ("torch", dict(attention="torch"))]:
        engine = Engine(load_pretrained(path, dtype=torch.float16, device=DEV), EngineConfig(**{**cfg, **extra}))
        outs[name] = [o.token_ids for o in engine.generate(reqs)]
        if name == "graph":
            assert engine.stats.graph_steps > 0
    assert outs["graph"] == outs["eager"]
    agree = sum(a == b for x, y in zip(outs["eager"], outs["torch"]) for a, b in zip(x, y))
    assert agree >= 0.95 * sum(len(x) for x in outs["torch"])  # fp16 kernels differ in rounding only


def test_memory_budget_sizes_the_pool_from_free_memory(tmp_path):
    path = checkpoint(tmp_path / "m", "gqa2")
    model = load_pretrained(path, dtype=torch.bfloat16, device=DEV)
    free, _ = torch.cuda.mem_get_info(DEV)
    engine = Engine(model, EngineConfig(gpu_memory_fraction=0.05, cuda_graphs=False))
    per_page = 4 * 2 * 16 * 2 * 64 * 2  # layers * (k, v) * page_size * Hkv * D * bytes
    assert abs(engine.pool.num_pages - int(free * 0.05) // per_page) <= engine.pool.num_pages * 0.02
    out = engine.generate([Request(0, [5, 6, 7], max_new_tokens=5, temperature=0.0, ignore_eos=True)])[0]
    assert len(out.token_ids) == 5


def test_missing_flashinfer_on_cuda_warns_and_names_the_fallback(tmp_path, monkeypatch):
    import hexrl.rollout.flashinfer_backend as fb

    path = checkpoint(tmp_path / "m", "gqa2")
    monkeypatch.setattr(fb, "import_flashinfer", lambda: (_ for _ in ()).throw(ImportError("no flashinfer")))
    model = load_pretrained(path, dtype=torch.bfloat16, device=DEV)
    with pytest.warns(RuntimeWarning, match="falling back to torch paged attention WITHOUT CUDA graphs"):
        engine = Engine(model, EngineConfig(max_pages=64))
    assert engine.backend.name == "torch" and engine.graphs is None
    with pytest.raises(ValueError, match="no flashinfer"):
        Engine(model, EngineConfig(max_pages=64, attention="flashinfer"))


def test_a_head_dim_flashinfer_does_not_dispatch_falls_back_instead_of_crashing(tmp_path):
    """head_dim 16 in bf16 (the CPU tiny model's shape): before the rule, Engine() died in graph warm-up."""
    make_tiny_model(tmp_path / "m", vocab=512, tie=False)
    model = load_pretrained(tmp_path / "m", dtype=torch.bfloat16, device=DEV)
    with pytest.warns(RuntimeWarning, match="head_dim 16"):
        engine = Engine(model, EngineConfig(max_pages=64))
    assert engine.backend.name == "torch" and engine.graphs is None
    out = engine.generate([Request(0, [5, 6, 7], max_new_tokens=5, temperature=0.0, ignore_eos=True)])[0]
    assert len(out.token_ids) == 5
