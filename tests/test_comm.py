"""Collectives as the harness counts them (``counting.counted``), batched point-to-point messages and the
hand-written ring all-reduce.

The ring and the wrappers run for real on 3 gloo ranks in one launch; the
NCCL-specific paths (batched P2P, the version fallbacks) are checked in this
process with spies on ``torch.distributed``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from course_lib.parallel import collectives as comm
from course_lib.experiments import launch
from course_lib.experiments.comm_spies import handed_bytes
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.workers.selftest import CommChecks

WORLD = 3  # not 2: 2(N-1)/N = 4/3 here, so a formula that ignores N would show


@pytest.fixture(scope="module")
def checks() -> CommChecks:
    return CommChecks.from_dict(launch.run("course_lib.experiments.workers.selftest", WORLD, ["--mode", "comm"], timeout=120))


def test_ring_all_reduce_equals_torch(checks):
    assert set(checks.ring) == {"3000", "3001"}
    for numel, r in checks.ring.items():
        assert r.max_abs_diff < 1e-5, f"{numel}: the ring sum differs from dist.all_reduce"


def test_ring_all_reduce_sends_2_n_minus_1_over_n(checks):
    even = checks.ring["3000"]
    assert even.tensor_bytes == 3000 * 4
    assert even.bytes == 2 * (WORLD - 1) / WORLD * even.tensor_bytes
    uneven = checks.ring["3001"]  # chunks of 1001/1000/1000 elements: off by at most a few elements
    assert abs(uneven.bytes - 2 * (WORLD - 1) / WORLD * uneven.tensor_bytes) <= 2 * (WORLD - 1) * 4


def test_ring_posts_one_batch_per_step(checks):
    # 2(N-1) steps, each one batch with the send to the right and the receive from the left
    for r in checks.ring.values():
        assert r.batches == [["isend", "irecv"]] * (2 * (WORLD - 1))


def test_counting_wrappers(checks):
    w = checks.wrappers
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        assert getattr(w, f"{op}_ok"), f"comm.{op} gave a wrong result"
        assert w.calls[op] == 1
    full = w.full_bytes
    assert w.by_op["all_reduce"] == pytest.approx(2 * (WORLD - 1) / WORLD * full)
    assert w.by_op["reduce_scatter"] == pytest.approx((WORLD - 1) / WORLD * full)
    assert w.by_op["all_gather"] == pytest.approx((WORLD - 1) / WORLD * full)
    assert w.bytes == pytest.approx(sum(w.by_op.values()))
    assert "multiple of 3" in checks.shape_error


def test_ring_factor_and_counter():
    assert comm.ring_factor("all_reduce", 1) == 0.0
    assert comm.ring_factor("all_reduce", 2) == 1.0
    assert comm.ring_factor("all_reduce", 64) == pytest.approx(2 * 63 / 64)
    with pytest.raises(ValueError, match="unknown collective"):
        comm.ring_factor("all_to_all", 2)
    c = ByteCounter()
    c.add("all_reduce", 10)
    c.add("all_reduce", 5)
    assert (c.bytes, c.by_op, c.calls) == (15, {"all_reduce": 15}, {"all_reduce": 2})
    c.reset()
    assert c.bytes == 0 and not c.by_op


def test_counted_adds_what_the_ring_sends(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    for name in ("all_reduce", "all_gather_single"):  # stand-ins with the real signatures: nothing to send to
        monkeypatch.setattr(dist, name, functools.wraps(getattr(dist, name))(lambda *a, **k: None))
    stand_in, other_group = dist.all_reduce, object()
    c, inner = ByteCounter(), ByteCounter()
    with counted(c), counted(inner, other_group):  # blocks nest, each counting the calls on its own group
        dist.all_gather_single(torch.zeros(6, dtype=torch.float64), torch.zeros(1))  # counts the output, the full one
        dist.all_reduce(torch.zeros(6, dtype=torch.float64))
        dist.all_reduce(torch.zeros(6), group=other_group)
    assert c.by_op == {"all_gather": 3 / 4 * 48, "all_reduce": 2 * 3 / 4 * 48}
    assert c.calls == {"all_gather": 1, "all_reduce": 1}
    assert inner.by_op == {"all_reduce": 2 * 3 / 4 * 24}
    assert dist.all_reduce is stand_in, "the block puts torch.distributed back as it found it"


# ----- in this process, with spies ---------------------------------------------------


class _Done:
    """A finished work object that, like gloo's, must be waited for once only."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.waited = log, name, False

    def wait(self):
        assert not self.waited, f"{self.name} waited twice (gloo would wait for a second message)"
        self.waited = True
        self.log.append(self.name)
        return True


def _fake_batch(log: list, coalesced: bool):
    """A stand-in for dist.batch_isend_irecv: records each batch; one work per op (gloo) or one in all (NCCL)."""
    def fake(ops):
        log.append([(op.op.__name__, op.peer, op.tensor.numel()) for op in ops])
        return [_Done(log, "group")] if coalesced else [_Done(log, f"{op.op.__name__}->{op.peer}") for op in ops]
    return fake


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone: what P2POp needs to exist (the batches themselves are faked)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ring_uses_batched_p2p_only(monkeypatch, one_process_group):
    log: list = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "batch_isend_irecv", _fake_batch(log, coalesced=True))
    # P2POp checks its op against the real isend/irecv, so they stay; a direct call is caught by this spy
    direct: list = []
    for name in ("send", "recv"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: direct.append(_n))
    t, c = torch.arange(8, dtype=torch.float32), ByteCounter()
    with counted(c, p2p="ring_all_reduce"):
        comm.ring_all_reduce(t)
    assert c.by_op == {"ring_all_reduce": 6 * 2 * 4}, "what the 6 sends of 2 float32 each carry"
    batches = [entry for entry in log if isinstance(entry, list)]
    assert batches == [[("isend", 2, 2), ("irecv", 0, 2)]] * 6, "2(N-1) batches: a send right, a receive left"
    assert log.count("group") == 6, "each batch is waited for before its chunk is used"
    assert not direct


def test_exchange_waits_for_receives_only_when_the_backend_allows(monkeypatch, one_process_group):
    a, b = torch.zeros(3), torch.zeros(5)
    for coalesced, received in ((False, ["irecv->1"]), (True, ["group"])):
        log: list = []
        monkeypatch.setattr(dist, "batch_isend_irecv", _fake_batch(log, coalesced))
        ex = comm.exchange([comm.Message(a, 2, tag=7)], [comm.Message(b, 1, tag=8)])
        assert log == [[("isend", 2, 3), ("irecv", 1, 5)]], "one batch holding both messages"
        ex.wait_received()
        assert log[1:] == received, "gloo: the receive alone; NCCL: the group"
        ex.wait()
        assert log[2:] == (["isend->2"] if not coalesced else []), "wait() waits for each work once"
    assert comm.exchange([], []).received == []


def test_collective_falls_back_to_the_older_names(monkeypatch):
    calls = []
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda out, inp, **kw: calls.append(("rs_tensor", kw)))
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, **kw: calls.append(("ag_into", kw)))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    comm.reduce_scatter(torch.empty(2), torch.empty(4))
    comm.all_gather(torch.empty(4), torch.empty(2))
    assert [c[0] for c in calls] == ["rs_tensor", "ag_into"]
    assert calls[0][1]["async_op"] is False and "op" in calls[0][1]
    monkeypatch.delattr(dist, "reduce_scatter_tensor")
    with pytest.raises(RuntimeError, match="neither dist.reduce_scatter_single nor dist.reduce_scatter_tensor"):
        comm.reduce_scatter(torch.empty(2), torch.empty(4))


def test_collective_prefers_the_newer_names():
    assert comm.collective("reduce_scatter_single", "reduce_scatter_tensor") is dist.reduce_scatter_single
    assert comm.collective("all_gather_single", "all_gather_into_tensor") is dist.all_gather_single


def test_handed_bytes_records_what_torch_distributed_receives(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: None)
    with handed_bytes("all_reduce") as sizes:
        dist.all_reduce(torch.zeros(10, dtype=torch.float64))
        dist.all_reduce(torch.zeros(3, dtype=torch.float16))
    assert sizes == [80, 6]
    dist.all_reduce(torch.zeros(4))  # restored: no longer recorded
    assert sizes == [80, 6]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per rank, NCCL)")
def test_ring_and_wrappers_on_nccl():
    c = CommChecks.from_dict(launch.run("course_lib.experiments.workers.selftest", 2, ["--mode", "comm"], timeout=300,
                                        env={"COURSE_DIST_BACKEND": "nccl"}))
    assert c.device.startswith("cuda")
    for r in c.ring.values():  # N = 2: both messages of a step go to the same peer, the case NCCL needs batched
        assert r.max_abs_diff < 1e-5 and r.bytes == pytest.approx(r.tensor_bytes, abs=8)
    w = c.wrappers
    assert w.all_reduce_ok and w.reduce_scatter_ok and w.all_gather_ok and w.broadcast_ok


def test_wrappers_call_this_torchs_names_without_deprecation_warnings(one_process_group):
    """In this torch ``reduce_scatter_single``/``all_gather_single`` are the names; the older ones warn."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning from a deprecated name would fail here
        out, full = torch.empty(4), torch.arange(4.0)
        comm.reduce_scatter(out, full)
        comm.all_gather(full, out.clone())
    assert torch.equal(full, torch.arange(4.0))
    if hasattr(dist, "reduce_scatter_single"):
        with pytest.warns(FutureWarning, match="reduce_scatter_single"):
            dist.reduce_scatter_tensor(out, full)
