"""Bytes counted exactly, and peaks measured (chapter 01; the peaks and timelines of chapters 05, 09 and 11).

Training memory has four parts:

- parameters: ``numel * element size`` of every parameter;
- gradients: one tensor like each trainable parameter (after ``backward``);
- optimizer state: SGD none, SGD with momentum one buffer, Adam two (``exp_avg`` and ``exp_avg_sq``) plus a
  scalar ``step`` per parameter tensor;
- activations: the tensors autograd saves during the forward pass for use in the backward pass. They grow
  with the batch and usually dominate.

``measure`` counts what really exists after a step; ``zero_memory`` is ZeRO's formula for the first three parts
on many devices. ``peak_bytes`` measures the peak during a step (CUDA's statistics, or on the CPU the profiler's
allocation records, those of the calling thread), ``memory_timeline`` the whole curve of allocated bytes over a
step, with its phases; both read the records with ``replay_allocations``. ``largest_fitting`` searches the
largest size that fits (chapter 02); ``estimator`` predicts the same bytes without running anything.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

GB = 1e9  # the ZeRO paper reports decimal gigabytes
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}  # precision -> autocast dtype (None: no autocast)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (not of a larger storage it may view)."""
    return t.numel() * t.element_size()


def param_bytes(model: nn.Module) -> int:
    """Bytes of all parameters, each shared parameter once."""
    return sum(tensor_bytes(p) for p in model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the ``.grad`` tensors that exist now (zero before the first backward)."""
    return sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (empty until its first step)."""
    return sum(tensor_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision name: None for ``"fp32"``, ``torch.bfloat16`` for ``"bf16"``."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose 'fp32' or 'bf16' (bf16 autocast)")
    return PRECISIONS[precision]


def device_type(device: torch.device | str) -> str:
    """``"cpu"`` or ``"cuda"``: the devices whose memory the course measures and estimates."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"the course measures and estimates memory on 'cpu' and 'cuda' (autocast's op lists and "
                         f"dropout's mask differ between them), not on {kind!r}")
    return kind


def _storage_key(t: torch.Tensor) -> int:
    # Views share one storage; key by the storage object's own address so each is counted once. (Its data
    # pointer would do for real tensors, but not for the fake ones of torch's FakeTensorMode, which have none.)
    return t.untyped_storage()._cdata


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs.

    Counted by storage (a view and its base count once) and without the storages of ``exclude`` (pass
    ``model.parameters()``: weights are saved too, but they are not activations).
    """
    excluded = {_storage_key(t) for t in exclude}
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # hold every saved tensor so no address is reused while we count

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in excluded:
            seen[key] = t.untyped_storage().nbytes()
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], inputs: torch.Tensor,
            targets: torch.Tensor, optimizer: torch.optim.Optimizer, precision: str = "fp32") -> dict[str, int]:
    """Run one real training step and count params, grads, optimizer state and saved activations
    (``precision="bf16"``: the forward pass under bf16 autocast on the inputs' device)."""
    amp = autocast_dtype(precision)
    optimizer.zero_grad(set_to_none=True)
    holder: list[torch.Tensor] = []

    def forward() -> None:
        with torch.autocast(inputs.device.type, dtype=amp, enabled=amp is not None):
            holder.append(loss_fn(model(inputs), targets))

    acts = saved_activation_bytes(forward, exclude=list(model.parameters()))
    holder[0].backward()
    optimizer.step()
    out = {"params": param_bytes(model), "grads": grad_bytes(model),
           "optimizer": optimizer_state_bytes(optimizer), "activations": acts}
    out["total"] = sum(out.values())
    return out


def zero_memory(num_params: float, num_devices: int, stage: int, optimizer_multiplier: float = 12, *,
                param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes per device of the model states under ZeRO (Rajbhandari et al. 2020, Figure 1).

    Each parameter costs ``param_bytes`` (2: fp16 weights) + ``grad_bytes`` (2: fp16 gradients) + K =
    ``optimizer_multiplier`` (12: fp32 master weights, momentum, variance). Stage 1 shards the K bytes over the
    devices, stage 2 the gradients too, stage 3 the weights too; stage 0 is plain data parallelism. Activations are
    not included. This is the course's one ZeRO formula: ``distributed.zero.zero_bytes_per_rank`` splits it into its
    parts (chapter 09).
    """
    if stage not in (0, 1, 2, 3) or num_devices < 1:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3 and num_devices at least 1, got {stage} and {num_devices}")
    n, d = float(num_params), float(num_devices)
    weights = param_bytes * n / (d if stage >= 3 else 1)
    grads = grad_bytes * n / (d if stage >= 2 else 1)
    states = optimizer_multiplier * n / (d if stage >= 1 else 1)
    return weights + grads + states


# ----- peak memory -----------------------------------------------------------------


@contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: the profiler's C++ side logs a few lines there at start and stop."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (some embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass
class MemoryTimeline:
    """Bytes allocated over time while a function ran, from the profiler's records (chapter 11)."""

    seconds: list[float]                      # since the first record
    live_bytes: list[int]                     # allocated above the start, after each allocation or free
    phases: dict[str, tuple[float, float]]    # a ``record_function`` label -> (start, end) in seconds

    @property
    def peak(self) -> int:
        return max([0, *self.live_bytes])

    def peak_in(self, phase: str) -> int:
        """The peak while the ``phase`` range was open."""
        if phase not in self.phases:
            raise KeyError(f"no phase {phase!r} was recorded; the function marked {sorted(self.phases)} "
                           "(wrap a part in torch.profiler.record_function(name))")
        start, end = self.phases[phase]
        return max([0, *(b for t, b in zip(self.seconds, self.live_bytes) if start <= t <= end)])


def replay_allocations(records: Iterable[tuple[int, int]]) -> list[int]:
    """Live bytes above the start after each ``(address, bytes)`` record: an allocation (bytes > 0) or a free.

    A free is matched to its allocation by address. The profiler records only what happens on the thread it was
    started in: a tensor made here but freed on another thread (gloo's workers free the copy a reduce-scatter makes
    of its input) leaves no free behind. Its block is known to be gone, at the latest, when the allocator hands out
    the same address again; one freed unseen and never reused counts to the end (too high). A tensor made on another
    thread leaves no record at all (too low). A free with no allocation seen is of a block made before: CUDA's
    allocator records those, and the curve goes below the start.
    """
    live: dict[int, int] = {}
    now, curve = 0, []
    for address, nbytes in records:
        if nbytes > 0:
            now -= live.pop(address, 0)  # an address handed out again: the block there was freed unseen
            live[address] = nbytes
            now += nbytes
        else:
            now -= live.pop(address, -nbytes)
        curve.append(now)
    return curve


def memory_timeline(fn: Callable[[], object], device: torch.device | str = "cpu",
                    phases: Iterable[str] = ("forward", "backward")) -> MemoryTimeline:
    """Every allocation and free of ``device``'s allocator while ``fn()`` runs, in time order.

    Replays the profiler's allocation records (``replay_allocations``), so it sees temporaries that live only inside
    an op. On the CPU, tensors made before ``fn`` are not seen at all, not even their frees, and neither are tensors
    made on other threads (measured in ``tests/test_memory.py``: 8 MiB made on a Python thread during ``fn`` leave
    no record). The parts of ``fn`` wrapped in ``torch.profiler.record_function(name)`` for a name in ``phases``
    come back as time ranges. The profiler slows the step down: the time axis orders events, it does not time them.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    kind = device_type(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
    prof = profile(activities=activities, profile_memory=True)
    with _quiet_native_stderr():
        prof.start()
    try:
        fn()
        if kind == "cuda":
            torch.cuda.synchronize(device)
    finally:
        with _quiet_native_stderr():
            prof.stop()
    # The tree of recorded events, not ``prof.events()``: there an allocation made inside an op is folded into
    # that op's totals, and its moment and address are lost.
    records, spans, wanted = [], {}, set(phases)
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.children))  # depth first, each op's children in the order they ran
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == kind:
            records.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif (node.tag == _EventType.TorchOp and node.name in wanted
              and node.start_time_ns >= spans.get(node.name, (-1, -1))[0]):  # a phase opened twice: its last
            spans[node.name] = (node.start_time_ns, node.end_time_ns)
    records.sort(key=lambda r: r[0])  # stable: records at the same nanosecond keep the tree's order
    t0 = min([t for t, _, _ in records] + [a for a, _ in spans.values()], default=0)
    return MemoryTimeline([(t - t0) / 1e9 for t, _, _ in records],
                          replay_allocations((address, nbytes) for _, address, nbytes in records),
                          {name: ((a - t0) / 1e9, (b - t0) / 1e9) for name, (a, b) in spans.items()})


def peak_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes allocated on ``device`` while ``fn()`` runs, above what was allocated before.

    On a GPU, CUDA's allocator statistics: exact, and cheap, whatever thread allocates. On the CPU, the profiler's
    allocation records replayed (``memory_timeline``): the peak of what *the calling thread* allocates. A tensor
    made on another thread (a Python thread, a data loader's) is missed: the figure is no bound on the process's
    memory. One made here and freed on another thread (the copy gloo's reduce-scatter makes of its input, which gloo
    makes on the calling thread and frees on its own) counts until its address is handed out again, so for the
    calling thread's own tensors the figure errs high.
    """
    if device_type(device) == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return memory_timeline(fn, "cpu", phases=()).peak


@contextmanager
def cuda_memory_history(path: str | Path, max_entries: int = 100_000, stacks: str = "python") -> Iterator[None]:
    """Record CUDA allocations to a snapshot file for https://pytorch.org/memory_viz (GPU only).

    ``stacks="python"`` keeps the Python stack of each allocation; ``"all"`` adds the C++ frames, whose
    symbolisation can make the dump take minutes on a long run.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


def largest_fitting(fits: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """The largest ``n`` in 1..limit with ``fits(n)`` true, assuming ``fits`` turns false once and stays false.

    Doubles until the first failure, then bisects: about 2 log2(n) calls of ``fits`` (each may be a real training
    step that runs out of memory). Returns 0 when even ``n = 1`` does not fit.
    """
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi) (or hi is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
