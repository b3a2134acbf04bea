"""NaiveDDP, BucketedDDP, DynamicBucketedDDP and torch DDP against one process on the whole batch (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib.experiments import launch
from course_lib.experiments.clock import CpuClock, slowest_rank_s
from course_lib.parallel.data_parallel.ddp import BucketedDDP, NaiveDDP, assign_buckets
from course_lib.experiments.ddp_checks import labelled
from course_lib.parallel.data_parallel.ddp_dynamic import DynamicBucketedDDP
from course_lib.models import MLP
from course_lib.experiments.workers.ddp_compare import SUPPORTED, CompareResult

TOL = 1e-5
WORLD = 2
TIMING_IN, TIMING_HIDDEN = 128, (128, 128)


@pytest.fixture(scope="module")
def result() -> CompareResult:
    # one launch for every check: starting ranks is the slow part on a small machine
    return CompareResult.from_dict(launch.run(
        "course_lib.experiments.workers.ddp_compare", WORLD,
        ["--steps", "4", "--timing-rounds", "1", "--timing-steps", "2", "--timing-in", str(TIMING_IN),
         "--timing-hidden", *map(str, TIMING_HIDDEN), "--bn"], timeout=240))


CASES = [(kind, scenario) for kind, scenarios in SUPPORTED.items() for scenario in scenarios]


@pytest.mark.parametrize("kind, scenario", CASES)
def test_equal_to_single_process(result, scenario, kind):
    r = result.equal[scenario][kind]
    assert r.grad_diff < TOL, f"{kind} gradients differ from one process ({scenario}): {r.grad_diff}"
    assert r.param_diff < TOL, f"{kind} parameters differ after the steps ({scenario}): {r.param_diff}"
    assert r.none_match, f"{kind}: a parameter without gradient in one process got one (or the reverse)"


def test_every_wrapper_is_checked_where_it_claims_to_work():
    assert set(SUPPORTED["dynamic"]) == set(SUPPORTED["naive"]) == {"frozen_shared", "reentrant", "unused"}
    assert SUPPORTED["bucketed"] == ("frozen_shared", "unused")


def test_bucketed_ddp_is_wrong_where_it_says_it_would_be(result):
    # a bucket sent at a parameter's first hook call misses the second accumulation
    assert result.equal["reentrant"]["bucketed"].grad_diff > 1e-3


def test_naive_and_bucketed_agree_on_a_parameter_unused_on_every_rank(result):
    # the aux head, unused on every rank on even steps: None in both, as in one process, so momentum leaves it
    for kind in ("naive", "bucketed"):
        unused = result.equal["unused"][kind]
        assert unused.none_match and unused.param_diff < TOL, kind


def test_hooks_fire_twice_under_reentrant_checkpoint(result):
    r = result.equal["reentrant"]
    assert r["dynamic"].max_hook_calls == 2, "the checkpointed shared block accumulates twice per backward"
    assert r["dynamic"].resent == 0, "with learned counts no bucket should leave early"
    first = r["dynamic_first_call"]
    assert first.resent > 0, "counting one call per parameter sends stale buckets, caught and re-sent"
    assert first.grad_diff < TOL, "the re-sends repair them"


def test_graph_change_resends_and_stays_equal(result):
    r = result.equal["unused"]["dynamic"]
    assert r.resent >= 1, "the aux head, unused on step 0, arrives late on odd steps: its bucket is re-sent"


def test_no_sync_saves_k_minus_1_all_reduces(result):
    n = result.no_sync
    for kind in ("torch", "bucketed", "dynamic"):
        assert n.every_micro_batch[kind] == n.k * n.no_sync[kind], n
        assert n.grad_diff[kind] < 1e-6, "no_sync must give the same accumulated gradient"
    assert n.buckets["bucketed"] >= 2


def test_communication_volume_against_the_model_and_the_process_group(result):
    """Bytes from the model's own parameter count and from what dist.all_reduce was handed, not from the counter."""
    model = MLP(TIMING_IN, TIMING_HIDDEN)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())            # float32
    tensors = len(list(model.parameters()))
    factor = 2 * (WORLD - 1) / WORLD                                          # the ring: 2(N-1)/N per rank
    s = result.timing.sent
    assert result.timing.grad_bytes == grad_bytes and result.timing.tensors == tensors
    # what the process group received: the gradients, plus DynamicBucketedDDP's flags per tensor and per
    # bucket (float32 each); NaiveDDP sends no flags (the plain loop: one all-reduce per gradient, nothing else)
    assert s["naive"].handed_bytes == grad_bytes and s["naive"].handed_calls == tensors
    assert s["bucketed"].handed_bytes == grad_bytes and s["torch"].handed_bytes == grad_bytes
    buckets = s["dynamic"].handed_calls
    assert s["dynamic"].handed_bytes == grad_bytes + 4 * (tensors + buckets)
    # the counted bytes: the ring formula applied to what was handed over
    assert s["naive"].bytes == factor * grad_bytes
    for kind in ("naive", "bucketed", "dynamic", "torch"):
        assert s[kind].bytes == factor * s[kind].handed_bytes, kind
        assert s[kind].messages == s[kind].handed_calls, kind
    assert s["naive"].messages == tensors, "NaiveDDP sends one message per tensor"
    assert s["bucketed"].messages < tensors


def test_sync_batchnorm(result):
    bn = result.batchnorm
    assert bn.grad_diff["sync_bn_by_hand"] < TOL
    assert bn.grad_diff["per_rank_bn"] > 1e-4, "per-rank statistics should change the gradient"
    assert bn.grad_diff["per_rank_bn"] > 100 * bn.grad_diff["sync_bn_by_hand"]
    assert bn.running_mean_spread["per_rank_bn"] > 0 and bn.running_mean_spread["sync_bn_by_hand"] == 0


def test_assign_buckets():
    assert assign_buckets([4, 4, 4, 4], cap_bytes=8) == [[3, 2], [1, 0]], "reverse order, two per bucket"
    assert assign_buckets([4, 20, 4], cap_bytes=8) == [[2], [1], [0]], "a tensor over the cap sits alone"
    assert assign_buckets([4, 4, 4], cap_bytes=100, keys=["a", "b", "b"]) == [[2, 1], [0]]
    assert assign_buckets([4, 4, 4, 4], cap_bytes=100, first_cap_bytes=4) == [[3], [2, 1, 0]]
    assert assign_buckets([], cap_bytes=8) == []
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([4], cap_bytes=0)


def test_wrappers_need_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        NaiveDDP(MLP(8, (4,)))
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedDDP(MLP(8, (4,)), bucket_cap_mb=0)
    with pytest.raises(RuntimeError, match="process group"):
        DynamicBucketedDDP(MLP(8, (4,)))


def test_labelled_draws_inputs_then_labels_and_slowest_rank_s_times_a_call():
    x, y = labelled(torch.Generator().manual_seed(0), (3, 4), (5,), torch.device("cpu"))
    assert x.shape == (3, 4, 5) and y.shape == (3, 4) and 0 <= y.min() and y.max() < 10
    assert torch.equal(x, torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wall, cpu = slowest_rank_s(lambda: sum(range(100_000)), CpuClock(), "cpu")
        assert wall > 0 and cpu >= 0
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank():
    """A gloo group of this process alone: the wrappers' collectives run, on one rank."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _SpareHead(torch.nn.Module):
    """An MLP with a second head that no forward uses: a parameter unused on every rank."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("wrapper", [NaiveDDP, BucketedDDP, DynamicBucketedDDP])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_parameter_unused_on_every_rank_keeps_no_gradient_and_adamw_leaves_it(one_rank, wrapper, set_to_none):
    """As in one process (and torch DDP with find_unused_parameters=True): grad None, so AdamW skips it."""
    torch.manual_seed(0)
    model = wrapper(_SpareHead())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    spare = [p.detach().clone() for p in model.module.spare.parameters()]
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        model(torch.randn(5, 8)).square().mean().backward()
        model.finish_gradient_synchronization()
        assert all(p.grad is None for p in model.module.spare.parameters()), f"{wrapper.__name__}, step {step}"
        assert all(p.grad is not None for p in model.module.head.parameters())
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.module.spare.parameters(), spare)), "AdamW moved it"


def test_bucketed_grads_are_views_into_their_buckets(one_rank):
    """No copy into a bucket and back: each .grad lies in its bucket's flat tensor, and stays there across steps."""
    torch.manual_seed(0)
    reference = MLP(8, (16, 16))
    model = BucketedDDP(MLP(8, (16, 16)), bucket_cap_mb=1000 / 2**20, first_bucket_mb=None)
    model.module.load_state_dict(reference.state_dict())
    assert len(model.buckets) >= 2
    held = None
    for step in range(3):
        model.zero_grad(set_to_none=False)   # keeps each .grad, zeroed in place: autograd adds into the bucket
        reference.zero_grad(set_to_none=True)
        x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.finish_gradient_synchronization()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        for b in model.buckets:
            for p in b.params:
                assert p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
        grads = [p.grad for p in model.params]
        if held is not None:
            assert all(g is h for g, h in zip(grads, held)), "the same tensors, step after step"
        held = grads
        assert max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(model.module.parameters(), reference.parameters())) < 1e-6
