# %% [markdown]
# ## Question 3 (2 points): the dispatch indices of a mixture of experts
#
# A mixture-of-experts layer (chapter 11, sections 9-10) routes each of `T` tokens to its `k` best experts. The
# router's choices arrive as a `(T, k)` tensor `expert` of expert ids, best first. Before the experts run, the
# choices are queued at their experts:
#
# - choice `a = slot * T + token` (**slot-major**: every token's first choice, then every token's second; so
#   `expert.t().reshape(-1)[a]` is choice `a`'s expert);
# - `order`: the choices sorted by expert; within one expert in increasing `a` (first choices ahead of second
#   choices, earlier tokens ahead of later ones: a *stable* sort);
# - `position[a]`: choice `a`'s place in its expert's queue, counting from 0;
# - `kept[a]`: whether choice `a` fits in the expert's `capacity`: an expert takes `capacity` choices, the first
#   `capacity` of its queue.
#
# Write `dispatch_indices(expert, n_experts, capacity)` returning `(order, position, kept)`: `order` and
# `position` as `torch.int64` tensors of `T * k` entries, `kept` as a `torch.bool` tensor. Raise `ValueError` when
# an id is outside `[0, n_experts)`. The example of the test: 5 tokens, one choice each, 3 experts, capacity 2:
# expert 0 is chosen by tokens 0, 2 and 4, so token 4 is third in its queue and dropped.

# %% nbgrader={"grade": false, "grade_id": "q3_dispatch_indices", "locked": false, "schema_version": 3, "solution": true}
def dispatch_indices(expert: torch.Tensor, n_experts: int,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queue the ``(T, k)`` choices at their experts: ``(order, position, kept)``, choice ``a = slot * T + token``."""
    ### BEGIN SOLUTION
    # HINT: flatten slot-major (expert.t().reshape(-1)), torch.argsort(..., stable=True) for the order; torch.bincount gives each expert's queue length, its cumulative sum where each queue starts in order.
    flat = expert.t().reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        raise ValueError(f"expert ids must lie in [0, {n_experts})")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel()) - starts[flat[order]]
    return order, position, position < capacity
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "q3_dispatch_indices_test", "locked": true, "points": 2, "schema_version": 3, "solution": false} course={"forbid": ["course_lib.moe.dispatch_indices", "course_lib.moe.route", "course_lib.moe.MoEMLP"]}
one_choice = torch.tensor([[0], [1], [0], [2], [0]])
two_choices = torch.tensor([[0, 1], [1, 2], [1, 0]])
many_ties = (torch.arange(60) % 3 == 0).long().view(60, 1)  # tokens 0, 3, 6, ... choose expert 1, the rest expert 0
### ANSWERS
got = {"ties": dispatch_indices(many_ties, 2, 60)[0], "one choice": dispatch_indices(one_choice, 3, 2), "two choices": dispatch_indices(two_choices, 3, 2),
       "bad id": raised(dispatch_indices, torch.tensor([[3]]), 3, 1), "good id": raised(dispatch_indices, torch.tensor([[2]]), 3, 1)}
### CHECKS
order, position, kept = got["one choice"]
assert type(order) is torch.Tensor and order.dtype == torch.int64 and kept.dtype == torch.bool, \
    "order and position: int64 tensors; kept: a bool tensor"
assert same(order, torch.tensor([0, 2, 4, 1, 3])), f"sorted by expert, ties in token order: expected [0, 2, 4, 1, 3], got {order.tolist()}"
assert same(position, torch.tensor([0, 0, 1, 0, 2])), f"places count from 0 in each expert's queue; got {position.tolist()}"
assert same(kept, torch.tensor([True, True, True, True, False])), \
    f"capacity 2 keeps places 0 and 1 (position < capacity, not <=); got {kept.tolist()}"
order, position, kept = got["two choices"]
assert same(order, torch.tensor([0, 5, 1, 2, 3, 4])), \
    f"slot-major: choice a = slot * T + token, all first choices before second ones; got {order.tolist()}"
assert same(kept, torch.tensor([True, True, True, False, True, True])), \
    "expert 1 is token 0's second choice and tokens 1 and 2's first: token 0's second choice queues last and is dropped"
assert same(got["ties"], torch.cat([torch.arange(60)[torch.arange(60) % 3 != 0], torch.arange(0, 60, 3)])), \
    "within one expert the choices keep their order: sort with stable=True"
assert str(got["bad id"]).startswith("ValueError") and got["good id"] is None, "an id >= n_experts: ValueError"
### BEGIN HIDDEN TESTS
dispatch_grid = []
for seed_, (t_, k_, e_, cap_) in enumerate([(50, 1, 4, 10), (64, 2, 8, 12), (200, 2, 16, 9), (33, 3, 5, 7), (1, 1, 1, 1)]):
    g_ = torch.Generator().manual_seed(seed_)
    choice_ = torch.stack([torch.randperm(e_, generator=g_)[:k_] for _ in range(t_)])
    dispatch_grid.append((choice_, e_, cap_))
skewed_ = torch.zeros(300, 1, dtype=torch.int64)  # everything at expert 0: a long queue of ties
skewed_[::7] = 1
dispatch_grid.append((skewed_, 2, 100))
### ANSWERS
got["grid"] = [dispatch_indices(*case) for case in dispatch_grid]
got["negative id"] = raised(dispatch_indices, torch.tensor([[-1]]), 3, 1)
### CHECKS
from course_lib.moe import dispatch_indices as reference_dispatch
for case, answer in zip(dispatch_grid, got["grid"]):
    want = reference_dispatch(*case)
    assert all(same(a, w) for a, w in zip(answer, want)), f"T, k = {tuple(case[0].shape)}, E = {case[1]}, capacity {case[2]}"
assert str(got["negative id"]).startswith("ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ## Question 4 (2 points): the counts exchange before the all-to-all
#
# With expert parallelism (chapter 11, section 11) `ep` ranks share `E` experts: rank `q` holds experts
# `q * E/ep, ..., (q+1) * E/ep - 1`. Each rank routes its own tokens; `counts[r][i]` is the number of rows rank `r`
# will send to expert `i` (a list of `ep` lists of `E` ints). Before `all_to_all_single` can move the rows, every
# rank needs its **send splits** (how many rows it sends to each rank) and its **receive splits** (how many rows
# it receives from each rank): uneven, since the router decides them. Rank `q` cannot know what it receives without
# hearing from the others: that is what the exchange of counts is for.
#
# Write `exchange_splits(counts, ep)` returning `(send, recv)`, two lists of `ep` lists of `ep` ints: `send[r][q]`
# the rows rank `r` sends to rank `q`, `recv[q][r]` the rows rank `q` receives from rank `r`. Raise `ValueError`
# when `ep` does not divide the number of experts or `counts` does not have one row per rank.

# %% nbgrader={"grade": false, "grade_id": "q4_exchange_splits", "locked": false, "schema_version": 3, "solution": true}
def exchange_splits(counts: list[list[int]], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Send and receive splits of the dispatch all-to-all, from every rank's rows per expert."""
    ### BEGIN SOLUTION
    # HINT: rank q's experts are a contiguous block of E // ep; what r sends to q is what q receives from r.
    if len(counts) != ep:
        raise ValueError(f"counts has {len(counts)} rows, one per rank expected ({ep})")
    n_experts = len(counts[0])
    if ep < 1 or n_experts % ep:
        raise ValueError(f"{ep} ranks cannot share {n_experts} experts evenly")
    per = n_experts // ep
    send = [[sum(row[q * per:(q + 1) * per]) for q in range(ep)] for row in counts]
    recv = [[send[r][q] for r in range(ep)] for q in range(ep)]
    return send, recv
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "q4_exchange_splits_test", "locked": true, "points": 2, "schema_version": 3, "solution": false} course={"forbid": ["course_lib.distributed.expert_parallel.exchange_counts", "course_lib.distributed.expert_parallel.ExpertParallelMoE"]}
counts_2 = [[3, 0, 5, 1],   # rank 0: 3 rows to expert 0, 5 to expert 2, ...
            [2, 2, 0, 4]]   # rank 1
### ANSWERS
got = {"2 ranks": exchange_splits(counts_2, 2), "3 of 4 experts": raised(exchange_splits, [[1, 1, 1, 1]] * 3, 3),
       "rows per rank": raised(exchange_splits, counts_2, 4)}
### CHECKS
send, recv = got["2 ranks"]
assert same(send, [[3, 6], [4, 4]]), \
    f"rank 0 holds experts 0 and 1, rank 1 experts 2 and 3: rank 0 sends 3 + 0 to rank 0 and 5 + 1 to rank 1; got {send}"
assert same(recv, [[3, 4], [6, 4]]), \
    f"recv[q][r] = send[r][q]: rank 1 receives 6 rows from rank 0 and 4 from itself; got {recv}"
assert str(got["3 of 4 experts"]).startswith("ValueError") and str(got["rows per rank"]).startswith("ValueError"), \
    "3 ranks for 4 experts, or 2 rows of counts for 4 ranks: ValueError"
### BEGIN HIDDEN TESTS
split_grid = []
for seed_, (ep_, e_) in enumerate([(1, 3), (2, 2), (4, 8), (3, 12), (8, 8)]):
    g_ = torch.Generator().manual_seed(100 + seed_)
    split_grid.append((torch.randint(0, 20, (ep_, e_), generator=g_).tolist(), ep_))
### ANSWERS
got["grid"] = [exchange_splits(*case) for case in split_grid]
### CHECKS
for (counts_, ep_), (send_, recv_) in zip(split_grid, got["grid"]):
    per_ = len(counts_[0]) // ep_
    want_send = [[sum(row[q * per_:(q + 1) * per_]) for q in range(ep_)] for row in counts_]
    assert same(send_, want_send), f"send splits, {ep_} ranks, {len(counts_[0])} experts"
    assert same(recv_, [list(col) for col in zip(*want_send)]), f"receive splits, {ep_} ranks"
    assert all(sum(r) == sum(row) for r, row in zip(send_, counts_)), "a rank sends every row it counted"
### END HIDDEN TESTS
