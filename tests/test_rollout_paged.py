"""Page pool, scheduler and the plain-torch paged attention backend."""
import pytest
import torch

from hexrl.model.attention import CausalAttention
from hexrl.rollout.attention_meta import build_meta
from hexrl.rollout.pages import PagePool
from hexrl.rollout.scheduler import Scheduler
from hexrl.rollout.sequence import Request, Sequence
from hexrl.rollout.torch_paged import TorchPagedAttention

HQ, HKV, D = 4, 2, 8


def pool(num_pages=64, page_size=4, layers=range(3, 5)):
    return PagePool(layers, num_pages, page_size, HKV, D, torch.float32, "cpu")


def test_pool_alloc_free_has_no_fragmentation():
    p = pool(num_pages=10)
    a, b = p.alloc(3), p.alloc(4)
    assert len(set(a) | set(b)) == 7 and p.num_free == 3
    p.free(a)
    c = p.alloc(6)  # freed pages are reusable whatever their ids
    assert p.num_free == 0 and sorted(b + c) == list(range(10))
    with pytest.raises(MemoryError, match="asked for 1 KV pages, 0 free"):
        p.alloc(1)
    table = []
    p.free(b + c)
    assert p.grow(table, 9) and len(table) == 3  # ceil(9 / 4)
    assert not p.grow(table, 41) and len(table) == 3  # 11 pages > 10: nothing taken
    assert p.layer(4).shape == (11, 2, 4, HKV, D)  # one scratch page at the end
    with pytest.raises(ValueError, match="num_pages must be a positive integer.*page_size"):
        PagePool(range(1), 0, -1, 1, 1, torch.float32, "cpu")


def seq(n_prompt, rid):
    return Sequence(req=Request(rid, list(range(1, n_prompt + 1)), max_new_tokens=100), seed=0,
                    tokens=list(range(1, n_prompt + 1)))


def engine_side(step):
    """What the engine does after a forward pass: mark tokens cached, append a sample."""
    for ch in step:
        ch.seq.num_cached = ch.start + ch.n
        if ch.samples:
            ch.seq.tokens.append(7)


def ids(step):
    return [(ch.seq.req.id, ch.start, ch.n) for ch in step]


def test_scheduler_chunks_prefill_under_the_token_budget():
    s = Scheduler(pool(), max_batch_tokens=10, max_running=8)
    a, b = seq(7, "a"), seq(6, "b")
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert ids(step) == [("a", 0, 7), ("b", 0, 3)] and [ch.samples for ch in step] == [True, False]
    engine_side(step)
    step = s.schedule()  # a decodes, b's prefill goes on
    assert ids(step) == [("a", 7, 1), ("b", 3, 3)] and [ch.samples for ch in step] == [True, True]


def test_scheduler_preempts_the_newest_when_pages_run_out():
    p = pool(num_pages=4, page_size=4)
    s = Scheduler(p, max_batch_tokens=10, max_running=8)
    a, b, c = seq(4, "a"), seq(4, "b"), seq(3, "c")
    for x in (a, b, c):
        s.add(x)
    step = s.schedule()  # c would need 1 page + 1 reserved per running seq > 2 free
    assert ids(step) == [("a", 0, 4), ("b", 0, 4)] and list(s.waiting) == [c]
    engine_side(step)
    for pos in range(4, 8):  # decodes fill the second page of each
        step = s.schedule()
        assert ids(step) == [("a", pos, 1), ("b", pos, 1)]
        engine_side(step)
    assert p.num_free == 0
    step = s.schedule()  # a needs a third page: b, the newest, is preempted (recompute later)
    assert ids(step) == [("a", 8, 1)] and s.preemptions == 1
    assert list(s.waiting) == [b, c] and b.pages == [] and b.num_cached == 0 and len(b.tokens) == 9
    assert p.num_free == 1
    s.drop_all_kv()  # an interrupt: everyone back in line, the running ones first
    assert list(s.waiting) == [a, b, c] and p.num_free == 4 and a.num_cached == 0 and not s.running


def kv_for(seq_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    return tuple(torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_prefill_then_decode_equals_causal_attention(page_size):
    lens = [5, 12, 1, 9]
    q, k, v = kv_for([n + 2 for n in lens])  # each sequence: a prompt, then two decode steps
    ref = CausalAttention([n + 2 for n in lens])(3, q, k, v)
    p = pool(page_size=page_size)
    tables = [p.alloc(-(-(n + 2) // page_size)) for n in lens]
    starts = torch.tensor([0] + [n + 2 for n in lens]).cumsum(0).tolist()

    def run(offset, count):  # tokens [offset, offset + count) of every sequence, in one step
        rows = torch.cat([torch.arange(s + offset(n), s + offset(n) + count(n)) for s, n in zip(starts, lens)])
        meta = build_meta([(t, offset(n), count(n)) for t, n in zip(tables, lens)], page_size, torch.device("cpu"))
        return rows, TorchPagedAttention(p, meta)(3, q[rows], k[rows], v[rows])

    for offset, count in [(lambda n: 0, lambda n: n), (lambda n: n, lambda n: 1), (lambda n: n + 1, lambda n: 1)]:
        rows, out = run(offset, count)
        torch.testing.assert_close(out, ref[rows], atol=1e-5, rtol=1e-5)
    assert p.layer(4).abs().sum() == 0 and p.layer(3).abs().sum() > 0  # only layer 3 was written


def test_mixed_step_of_prefill_chunks_and_decodes():
    lens = [20, 3, 8]
    q, k, v = kv_for(lens, seed=1)
    ref = CausalAttention(lens)(3, q, k, v)
    p = pool(page_size=4)
    tables = [p.alloc(-(-n // 4)) for n in lens]
    starts = [0, 20, 23]
    # step 1: first 13 tokens of seq 0, all but the last of the others; step 2: the rest of each
    for split in ([(0, 13), (0, 2), (0, 7)], [(13, 7), (2, 1), (7, 1)]):
        rows = torch.cat([torch.arange(s + a, s + a + n) for s, (a, n) in zip(starts, split)])
        meta = build_meta([(t, a, n) for t, (a, n) in zip(tables, split)], 4, torch.device("cpu"))
        torch.testing.assert_close(TorchPagedAttention(p, meta)(3, q[rows], k[rows], v[rows]), ref[rows],
                                   atol=1e-5, rtol=1e-5)
    csr = meta.csr()  # FlashInfer's view of the last step
    assert csr["qo_indptr"].tolist() == [0, 7, 8, 9] and csr["kv_indptr"].tolist() == [0, 5, 6, 8]
    assert csr["kv_last_page_len"].tolist() == [4, 3, 4] and csr["kv_indices"].tolist() == sum(tables, [])
