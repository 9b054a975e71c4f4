"""A decode step's host-to-device traffic on the torch-paged path: its inputs (slots, lengths and the
page table's new entries) go over in exactly one upload, and nothing else in the step builds a tensor
from host data (on a GPU each such tensor is one more host-to-device copy)."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.attention_meta import build_meta, decode_slots
from hexrl.rollout.flashinfer_backend import pad_csr
from hexrl.rollout.sampler import SlotParams
from hexrl.rollout.sequence import Sequence

HOST_DATA = {"tensor", "as_tensor"}  # tensors built from Python data: on a GPU, a host-to-device copy each
FACTORIES = {"arange", "zeros", "ones", "full", "empty", "randint", "rand", "randn"}


class HostTensors(TorchFunctionMode):
    """Records torch calls that make a tensor on the host: from Python data, or a factory with no device."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_DATA or (name in FACTORIES and kwargs.get("device") is None):
            self.calls.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_step_makes_one_upload_and_no_other_host_tensor(tmp_path, overlap):
    path = make_tiny_model(tmp_path / "m", vocab=64, tie=False)
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64, max_running=4, overlap=overlap),
                    eos_ids=[])
    modes = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)]
    for i, n in enumerate([3, 9, 5, 6]):  # unequal contexts: the masked decode path; pages fill at different steps
        engine.add(Request(i, list(range(1, n + 1)), max_new_tokens=9, seed=i, ignore_eos=True, **modes[i % 3]))
    runner, entries, kinds, admitted = engine.runner, [], [], []
    take = engine.scheduler.tables.take
    engine.scheduler.tables.take = lambda: entries.append(take()) or entries[-1]
    prepare_decode = runner.prepare_decode
    runner.prepare_decode = lambda seqs, admitted=(): kinds.append("decode") or prepare_decode(seqs, admitted)
    prepare = runner.prepare
    runner.prepare = lambda chunks, new=(): kinds.append("any") or admitted.append(len(new)) or prepare(chunks, new)
    decode_steps = 0
    while engine.has_work():
        kinds.clear()
        uploads = runner.uploads
        with HostTensors() as host:
            engine.step()
        if kinds:  # a step was launched: the prefill, with its admissions, too makes one upload
            assert runner.uploads - uploads == 1
        if kinds == ["decode"]:
            decode_steps += 1
            assert runner.uploads - uploads == 1, f"decode step {decode_steps}: {runner.uploads - uploads} uploads"
            assert host.calls == [], f"decode step {decode_steps} built host tensors: {host.calls}"
    assert engine.stats.mixed_steps == 1 and decode_steps == 8  # one prefill of all four, then decodes only
    assert sum(1 for e in entries if e) >= 3, "some decode steps should have carried new page-table entries"
    assert admitted[0] == 4  # the prefill admitted all four


def test_admission_parameters_travel_as_one_int_list_and_land_exactly():
    params = SlotParams(4, torch.device("cpu"))
    reqs = [Request("a", [5, 6], temperature=0.7, top_k=3, top_p=0.35, seed=11),
            Request("b", [9], temperature=0.0, top_p=1.0, seed=(1 << 31) - 1)]
    seqs = [Sequence(req=r, seed=r.seed, tokens=list(r.prompt_ids)) for r in reqs]
    seqs[0].slot, seqs[1].slot = 2, 0
    values = params.admission(seqs)
    assert all(isinstance(v, int) for v in values) and len(values) == 7 * 2
    params.admit_from(torch.tensor(values, dtype=torch.int64))
    want_t, want_p = torch.tensor([0.0, 0.7], dtype=torch.float32), torch.tensor([1.0, 0.35], dtype=torch.float32)
    assert torch.equal(params.temperature[[0, 2]], want_t) and torch.equal(params.top_p[[0, 2]], want_p)
    assert params.top_k[[0, 2]].tolist() == [0, 3] and params.seed[[0, 2]].tolist() == [(1 << 31) - 1, 11]
    assert params.num_prompt[[0, 2]].tolist() == [1, 2] and params.last_token[[0, 2]].tolist() == [9, 6]
    assert params.temperature[[1, 3, 4]].tolist() == [0.0] * 3  # other slots untouched


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["torch", "flashinfer"])
def test_gpu_decode_step_host_to_device_copies(tmp_path, attention):
    """Counts the HtoD memcpys the CUDA profiler sees in steady decode steps. Torch-paged: exactly one per
    step, from pinned memory. FlashInfer with graphs: ours plus what its plan() copies (indptr and
    last_page_len from the host, its plan info), printed; at most 4."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if attention == "flashinfer":
        pytest.importorskip("flashinfer")
    # head_dim 64: one FlashInfer dispatches (the default tiny model's 16 would take the torch path)
    path = make_tiny_model(tmp_path / "m", vocab=64, tie=False, hidden=256, heads=4, kv_heads=2)
    cfg = EngineConfig(page_size=4, max_pages=64, max_running=4, attention=attention, overlap=False,
                       cuda_graphs=attention == "flashinfer")
    engine = Engine(load_pretrained(path, dtype=torch.float16, device="cuda"), cfg, eos_ids=[])
    for i, n in enumerate([3, 9, 5, 6]):
        engine.add(Request(i, list(range(1, n + 1)), max_new_tokens=12, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # prefill, then warm decodes
        engine.step()
    steps = 4
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    h2d = [e.name for e in prof.events() if "HtoD" in e.name]
    print(f"{attention}: {len(h2d)} HtoD copies in {steps} decode steps: {sorted(set(h2d))}")
    assert engine.stats.mixed_steps == 1
    if attention == "torch":
        assert len(h2d) == steps and all("Pinned" in name for name in h2d), h2d
    else:
        assert steps <= len(h2d) <= 4 * steps, h2d


def test_the_graph_prologue_gathers_the_slots_the_eager_step_would(tmp_path):
    """`decode_slots` (what the CUDA-graph prologue runs) over the padded rows of a decode step: the real
    rows get the step's slot pages and offsets, the padding rows the table's padding row (scratch page)."""
    path = make_tiny_model(tmp_path / "m", vocab=64, tie=False)
    engine = Engine(load_pretrained(path), EngineConfig(page_size=4, max_pages=64, max_running=4), eos_ids=[])
    for i, n in enumerate([3, 8, 6]):
        engine.add(Request(i, list(range(1, n + 1)), max_new_tokens=9, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    step = engine.runner.prepare_decode(engine.scheduler.decode_only())
    pad = engine.params.pad_slot
    rows = torch.cat([step.rows, torch.tensor([pad])])
    kv_lens = torch.cat([step.kv_lens, torch.tensor([1])])
    positions, pages, offsets = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), torch.zeros(4)
    decode_slots(engine.scheduler.tables.table, rows, kv_lens, 4, positions, pages, offsets)
    meta = step.meta
    assert positions.tolist() == meta.positions.tolist() + [0]
    assert pages.tolist() == meta.slot_pages.tolist() + [engine.pool.scratch_page]
    assert offsets.tolist() == meta.slot_offsets.tolist() + [0]
    assert len(set(meta.slot_pages.tolist())) == 3  # three sequences, three different pages


def test_graph_plan_gathers_page_indices_into_the_wrappers_buffer():
    """What GraphDecodeAttention.plan hands FlashInfer: the same arrays as the copying path, with
    kv_indices a view of the static indices buffer (so FlashInfer's copy into that buffer is a no-op)."""
    meta = build_meta([([5, 6, 7], 0, 9), ([2], 0, 3), ([8, 9], 0, 5)], 4, torch.device("cpu"))
    buf = torch.full((16,), -1, dtype=torch.int32)
    got, want = pad_csr(meta.csr(buf), 5, 63, buf), pad_csr(meta.csr(), 5, 63)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert got["kv_indices"].tolist() == [5, 6, 7, 2, 8, 9, 63, 63]
    assert got["kv_indices"].data_ptr() == buf.data_ptr() and buf[8:].tolist() == [-1] * 8
