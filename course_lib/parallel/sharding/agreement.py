"""The opt-in layer for ranks that do not all run the same backward: ``GuardedZeroOptimizer`` (chapter 09).

A collective returns only when every rank has called it: a rank that calls one its peers never call waits, on
NCCL for ever (or for the process group's timeout). Stage 2 starts its reduce-scatters from gradient hooks, so a
rank that skips a backward, or raises in one, leaves its peers waiting. This subclass keeps every rank's sequence of
collectives the same, at a price the plain version does not pay: small blocking flag all-reduces read on the host,
as a backward starts, as it ends (which ranks failed, which buckets any rank had a gradient for) and in ``step``
(to join with zeros a backward this rank skipped, as torch's ``Join`` does for DDP): a barrier and a host sync per
backward, which DeepSpeed and FSDP do not pay. Parameters a backward will not reach count as arrived when it starts;
a bucket no rank had a gradient for keeps ``piece.grad = None`` (Adam skips it); a gradient that arrives twice
raises on every rank together; stage 1 refuses gradients changed in place after the backward or ``step``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.sharding.zero import ZeroOptimizer

MISUSE = ("(clip_grad_norm_ on the model?). Under ZeRO each rank holds its own, unaveraged gradient until step() "
          "reduces it, and afterwards the mean only in its own slice: clip (or read the norm) with "
          "ZeroOptimizer.clip_grad_norm_(max_norm) between the backward and step(); scale the loss to scale it")


def flag_group() -> dist.ProcessGroup | None:
    """The group the flags travel on, as CPU tensors: the default one where it has gloo (gloo, or launch's
    ``cpu:gloo,cuda:nccl``), else a gloo group of the same ranks (made collectively). The flags are read on the
    host at once: summed on the GPU through NCCL, reading them would make the host wait for everything the device
    has queued, mid-backward and at its end. Through gloo it costs a round trip between the hosts."""
    return None if "gloo" in str(dist.get_backend()).lower() else dist.new_group(backend="gloo")


class GuardedZeroOptimizer(ZeroOptimizer):
    """``ZeroOptimizer`` whose ranks agree on what each backward did; ``control_calls`` counts the flag all-reduces.
    Stage 2 spends two per backward and one per ``step`` or ``clip_grad_norm_``, plus two for each backward of
    another rank that it joins (the question, and the end). Stage 1 needs none: its collectives all run in ``step``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.control_calls = 0
        self._error: str | None = None           # what went wrong on this rank in this backward
        self._used = [False] * len(self.buckets)  # per bucket: a gradient of it arrived on this rank
        self._fresh = [False] * len(self.buckets)  # per bucket: ``piece.grad`` was None as this backward began
        self._noted: int | None = None            # stage 1: the gradient buffer's version when last seen
        if self.stage == 2:
            self._flag_group = flag_group()
            with torch.enable_grad():  # each parameter's AccumulateGrad node: will this backward reach it?
                self._grad_accs = [p.view_as(p).grad_fn.next_functions[0][0] for p in self.params]
        else:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._note)

    def _flags(self, flags: list[int], at: int | None = None) -> list[int]:
        """Sum integer ``flags`` over the ranks, blocking (``at``: set flag ``at`` to 1 on this rank first)."""
        t = torch.tensor([int(f or k == at) for k, f in enumerate(flags)], dtype=torch.int32)  # host (flag_group)
        dist.all_reduce(t, group=self._flag_group)
        self.control_calls += 1
        return t.tolist()

    # ----- stage 2 ----------------------------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        """Say that this rank is in a backward; count the parameters it will not reach as arrived, with zeros."""
        super()._begin_backward()
        self._fresh = [b.piece.grad is None for b in self.buckets]
        self._flags([1])  # ranks that skipped their backward answer from step() and join it with zeros
        for i, acc in enumerate(self._grad_accs):
            # No public API tells, as a backward starts, whether it will reach a node: register_multi_grad_hook
            # asks this same private function inside, and tells only once the gradients have come. DDP's
            # find_unused_parameters walks the graph from the forward's outputs, blind to a loss built elsewhere.
            if i not in self._done and not torch._C._will_engine_execute_node(acc):
                self._mark(i)  # unused here: zeros, and its bucket need not wait for the end

    def _reduce(self, k: int) -> None:
        self._used[k] = self._grads[k] is not None
        super()._reduce(k)

    def _arrived_twice(self, i: int, p: torch.Tensor) -> None:
        """Note the error; every rank raises it together at the end of the backward."""
        self._error = self._error or (f"a gradient of parameter {i} arrived twice in one backward (or after it "
                                      "was counted unused): reentrant checkpointing? use use_reentrant=False")
        p.grad = None

    def _end_backward(self) -> None:
        """Send what is left and wait for it, then agree on errors and on the buckets no rank had a gradient for."""
        super()._end_backward()
        summed = self._flags([0] * self.world + [int(u) for u in self._used], at=self.rank if self._error else None)
        failed, used = summed[:self.world], summed[self.world:]
        for b, u, fresh in zip(self.buckets, used, self._fresh):
            if u == 0 and fresh:  # no rank had a gradient for it: no gradient at all, so Adam skips it
                b.piece.grad = None
        mine, self._error = self._error, None
        if any(failed):  # every rank raises together
            raise RuntimeError(f"ZeroOptimizer: the backward failed on rank(s) {[r for r, e in enumerate(failed) if e]}"
                               + (f": {mine}" if mine else ""))

    # ----- both stages: before the gradient is read ---------------------------------------------------------------

    def _reduce_gradients(self) -> None:
        """Stage 2: join with zeros every backward another rank still runs. Stage 1: check that nobody changed the
        gradient in place since the backward. Then reduce as ``ZeroOptimizer`` does."""
        if self.stage == 2:
            while self._flags([0])[0] > 0:  # some rank is in a backward this one skipped
                self._in_backward = True
                self._fresh = [b.piece.grad is None for b in self.buckets]
                self._end_backward()  # every parameter unused here: zeros for every bucket
        elif not self._reduced:
            self._check("after the backward")
        super()._reduce_gradients()

    # ----- stage 1: the gradient buffer's version counter -----------------------------------------------------------
    # Each rank checks on its own, with no flag: the misuse this is for runs the same code on every rank, so every
    # rank raises before any collective. It costs a comparison of two integers.

    def _note(self, p: torch.Tensor) -> None:
        if self.flat_grads is not None:  # autograd accumulated into it: note its version (views share their base's)
            self._noted = self.flat_grads._version

    def _check(self, since: str) -> None:
        noted, self._noted = self._noted, None  # said once
        if noted is not None and self.flat_grads is not None and self.flat_grads._version != noted:
            raise RuntimeError(f"the gradients were changed in place {since} {MISUSE}")

    def zero_grad(self) -> None:
        if self.stage == 1:
            self._check("after step()")
        super().zero_grad()

    def step(self) -> None:
        super().step()
        if self.stage == 1:
            self._noted = self.flat_grads._version  # zero_grad checks that nobody changed it since
