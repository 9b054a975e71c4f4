"""The engine's fast-path bookkeeping on CPU: the device-side page table, the decode-only schedule,
the CUDA-graph buffers shared by every captured size, the graph/workspace settings, and the CPU
linears over prepacked oneDNN weights."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.attention_meta import build_meta
from hexrl.rollout.cpu_linear import available, pack_linears
from hexrl.rollout.cuda_graph import SharedGraphBuffers, batch_size_problems, default_batch_sizes, pick_size
from hexrl.rollout.flashinfer_backend import WORKSPACE_BYTES, float_workspace_bytes, pad_csr
from hexrl.rollout.pages import BlockTable, PagePool
from hexrl.rollout.scheduler import Scheduler
from hexrl.rollout.sequence import Sequence


def test_block_table_is_fixed_width_and_applies_the_entries_it_hands_over():
    t = BlockTable(rows=3, device="cpu", width=4)
    table = t.table
    t.append(1, 0, [7, 8])
    assert t.table[1, :2].tolist() == [0, 0]  # nothing written before the entries are applied
    t.flush()
    t.append(1, 2, [9])
    t.append(0, 0, [4])
    entries = t.take()
    assert entries == [1 * 4 + 2, 0, 9, 4] and t.take() == []  # flat indices, then pages; taken once
    assert t.apply(torch.tensor(entries)) is table  # one allocation: the address graphs may hold never moves
    assert table.dtype == torch.int32 and table.shape == (3, 4)
    assert table[1, :3].tolist() == [7, 8, 9] and table[0, 0] == 4
    with pytest.raises(ValueError, match="row 2 needs 5 pages, the table holds 4"):
        t.append(2, 3, [1, 2])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("fast") / "m", vocab=64, tie=False)
    return Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64, max_running=4), eos_ids=[])


def test_device_table_matches_the_host_block_tables(engine):
    """After prefill and a few decodes (pages appended as contexts cross page boundaries), the
    decode step's metadata built from the device table equals build_meta from the host lists."""
    for i, n in enumerate([3, 9, 5]):
        engine.add(Request(i, list(range(1, n + 1)), max_new_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    seqs = engine.scheduler.decode_only()
    assert seqs is not None and len(seqs) == 3  # nothing waits: the decode-only path is taken
    got = engine.runner.prepare_decode(seqs).meta
    want = build_meta([(s.pages, s.num_cached, 1) for s in seqs], 4, torch.device("cpu"))
    for name in ("positions", "slot_pages", "slot_offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.kv_lens == want.kv_lens
    for g, w in zip(got.block_table.tolist(), [s.pages for s in seqs]):
        assert g[:len(w)] == w
    gc, wc = got.csr(), want.csr()
    assert all(torch.equal(gc[k], wc[k]) for k in wc)


def test_decode_only_defers_to_the_general_schedule_when_someone_can_be_admitted():
    pool = PagePool(range(1), 16, 4, 1, 8, torch.float32, "cpu")
    s = Scheduler(pool, max_batch_tokens=64, max_running=2)
    a = Sequence(req=Request("a", [1, 2, 3]), seed=0, tokens=[1, 2, 3])
    s.add(a)
    assert s.decode_only() is None  # a waits and there is room
    assert [c.n for c in s.schedule()] == [3]
    a.num_cached, a.tokens = 3, a.tokens + [5]  # what the engine does after sampling
    assert s.decode_only() == [a] and len(a.pages) == 1  # 4 tokens fit the first page
    a.num_cached, a.tokens = 4, a.tokens + [6]
    assert s.decode_only() == [a] and len(a.pages) == 2  # the fifth token starts a page
    assert s.tables.flush()[a.slot, :2].tolist() == a.pages


def test_graph_buffers_are_shared_by_every_size():
    buf = SharedGraphBuffers(max_batch=16, vocab=10, device=torch.device("cpu"))
    views = {bs: buf.views(bs) for bs in (1, 8, 16)}
    for ids, _pos, logits in views.values():  # one allocation: every size's views start at the same place
        assert ids.data_ptr() == buf.ids.data_ptr() and logits.data_ptr() == buf.logits.data_ptr()
        assert logits.dtype == torch.float32
    assert views[8][2].shape == (8, 10)
    buf.ids.fill_(9)
    buf.load(torch.tensor([3, 4, 5]), torch.tensor([10, 11, 12]), bs=8)
    assert buf.ids[:8].tolist() == [3, 4, 5, 0, 0, 0, 0, 0] and buf.positions[:4].tolist() == [10, 11, 12, 0]
    assert buf.ids[8:].tolist() == [9] * 8  # rows past the graph's size are not touched


def test_graph_sizes_default_validation_and_choice():
    assert default_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert default_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert pick_size([1, 2, 4, 8, 12], 5) == 8 and pick_size([1, 2, 4, 8, 12], 12) == 12
    with pytest.raises(ValueError, match="no captured graph holds 13 rows"):
        pick_size([1, 2, 4, 8, 12], 13)
    assert batch_size_problems((1, 8), 8) == []
    assert "exceeds the running-batch limit 8" in batch_size_problems((1, 16), 8)[0]
    assert "integers >= 1" in batch_size_problems((0, 2), 8)[0]
    assert "duplicates" in batch_size_problems((2, 2), 8)[0]
    assert "non-empty" in batch_size_problems((), 8)[0]
    problems = EngineConfig(max_running=4, graph_batch_sizes=(1, 8)).problems()
    assert problems == ["graph_batch_sizes 8 exceeds the running-batch limit 4 (min of max_running and "
                        "max_batch_tokens)"]


def test_padded_csr_points_padding_rows_at_the_scratch_page():
    meta = build_meta([([5, 6], 0, 1 + 4), ([2], 0, 3)], 4, torch.device("cpu"))  # kv 5 and 3 tokens
    padded = pad_csr(meta.csr(), batch_size=4, scratch_page=63)
    assert padded["kv_indptr"].tolist() == [0, 2, 3, 4, 5]
    assert padded["kv_indices"].tolist() == [5, 6, 2, 63, 63]
    assert padded["kv_last_page_len"].tolist() == [1, 3, 1, 1]
    assert padded["qo_indptr"].tolist() == [0, 1, 2, 3, 4]


def test_float_workspace_grows_with_wide_models_and_big_batches():
    assert float_workspace_bytes(12, 2, 128, 256) == WORKSPACE_BYTES  # 1.5B at 256: the default suffices
    big = float_workspace_bytes(40, 8, 128, 512)  # 14B-wide (40 q heads) at 512 sequences
    assert big > WORKSPACE_BYTES and big == 512 * 40 * 129 * 4 * 32


def test_host_overhead_bench_runs_and_prints_its_headline(monkeypatch, capsys):
    import sys

    from tools.bench import bench_host_overhead

    monkeypatch.setattr(sys, "argv", ["bench", "--batch", "4", "--context", "8", "--steps", "3", "--repeats", "1"])
    bench_host_overhead.main()
    out = capsys.readouterr().out
    assert "host ms per decode step: " in out and "with the CPU torch sampler" in out


needs_onednn = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_a_float64_reference(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias)
    assert pack_linears(lin) == [lin.forward]
    x = torch.randn(rows, 96)
    with torch.no_grad():
        got = lin(x)
    assert lin.forward.packed is not None  # the oneDNN path ran
    want = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@needs_onednn
def test_packed_linear_keeps_gradients_and_follows_weight_writes():
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    pack_linears(lin)
    x = torch.randn(5, 16)
    lin(x).square().sum().backward()  # training takes F.linear: gradients flow, nothing is packed
    assert lin.weight.grad is not None and lin.forward.packed is None

    def plain():
        return F.linear(x, lin.weight, lin.bias)

    with torch.no_grad():
        torch.testing.assert_close(lin(x), plain())
        lin.weight.mul_(2)  # an in-place write bumps the version counter: repacked
        torch.testing.assert_close(lin(x), plain())
        lin.weight.data.mul_(2)  # a write the counter misses, as a broadcast into the weight is
        stale = lin(x)
        assert not torch.allclose(stale, plain())
        lin.forward.drop()
        torch.testing.assert_close(lin(x), plain())


@needs_onednn
def test_a_broadcast_style_weight_update_reaches_the_packed_linears(tmp_path):
    """update_weights with a loader that writes through .data (as dist.broadcast does, leaving the
    version counter alone) must still generate with the new weights."""
    cfg = EngineConfig(page_size=4, max_pages=32)
    paths = [make_tiny_model(tmp_path / name, seed=seed, vocab=64, tie=False) for name, seed in (("a", 0), ("b", 1))]

    def run(engine):
        return engine.generate([Request(0, [5, 6, 7, 8, 9], max_new_tokens=8, temperature=0.0, ignore_eos=True)])[0]

    engine = Engine(load_pretrained(paths[0]), cfg, eos_ids=[])
    assert len(engine.packed) == 4 * engine.model.cfg.num_hidden_layers + 1  # qkv, o, gate_up, down; lm_head
    before = run(engine)
    new = load_pretrained(paths[1], fused=True).state_dict()  # the engine's own (fused) names

    def like_a_broadcast(model):
        for name, p in model.named_parameters():
            p.data.copy_(new[name])

    engine.update_weights(like_a_broadcast, version=1)
    after, fresh = run(engine), run(Engine(load_pretrained(paths[1]), cfg, eos_ids=[]))
    assert after.token_ids == fresh.token_ids
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(fresh.logprobs), atol=1e-5, rtol=0)
    assert not torch.allclose(torch.tensor(before.logprobs), torch.tensor(fresh.logprobs), atol=1e-3)


@needs_onednn
def test_the_hf_comparison_runs_and_both_sides_agree(monkeypatch, capsys):
    """tools/bench/bench_cpu_vs_hf.py end to end at a toy size, HF given the same oneDNN linears: the two
    sides' greedy tokens must be identical (the script prints 'NO' otherwise)."""
    import sys

    pytest.importorskip("transformers")
    from tools.bench import bench_cpu_vs_hf

    monkeypatch.setattr(sys, "argv", ["bench", "--batch", "3", "--prompt-len", "8", "--output-len", "5",
                                      "--repeats", "1", "--hf-onednn"])
    bench_cpu_vs_hf.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["3"]]
    assert [r[1] for r in rows] == ["wall", "CPU"] and all(r[5] == "yes" for r in rows)
