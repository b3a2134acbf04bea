# %% [markdown]
# <!-- STANDALONE PREAMBLE: the next two cells let this section run on its own
#      (`COURSE_PROFILE=smoke python handoff/moe_section.py`). In the chapter, drop them: merge MOE_SIZES'
#      entries into the chapter's SIZE_TABLE and its imports into the chapter's import cell (see README.md). -->

# %%
import inspect
import statistics
import time

import torch

from course_lib import moe
from course_lib.distributed import expert_parallel as ep
from course_lib.distributed import launch
from course_lib.env import pick_profile, seed_everything, sizes
from course_lib.tools import plots
from course_lib.tools.report import record
from course_lib.workers.ep_results import EPReport

# %%
PROFILE = None
# The mixture of experts (sections 9-10): E experts of width moe_d (hidden 2 x moe_d), moe_tokens tokens per
# batch, trained moe_steps Adam steps on moe_seeds seeds with and without the auxiliary loss (weight moe_aux).
# Expert parallelism (sections 11-12): one MoE layer of E experts, width ep_d, hidden ep_hidden, ep_tokens tokens
# per rank, on 2 and on 4 ranks (one launch each); ep_timeout: seconds per launch.
# Measured on a busy 2-core machine (load about 10): smoke about 50 s, cpu about 70 s of wall time for this half.
MOE_SIZES = {
    "smoke": dict(moe_experts=8, moe_d=16, moe_tokens=256, moe_steps=40, moe_seeds=2, moe_aux=0.1,
                  ep_d=8, ep_hidden=16, ep_tokens=16, ep_timeout=300),
    "cpu": dict(moe_experts=8, moe_d=16, moe_tokens=512, moe_steps=60, moe_seeds=3, moe_aux=0.1,
                ep_d=32, ep_hidden=64, ep_tokens=64, ep_timeout=600),
    # gpu: the same code at larger sizes, the ranks on the CPU (estimated: about 3 x the cpu section)
    "gpu": dict(moe_experts=16, moe_d=32, moe_tokens=2048, moe_steps=100, moe_seeds=5, moe_aux=0.1,
                ep_d=64, ep_hidden=256, ep_tokens=256, ep_timeout=900),
}
PROFILE = pick_profile(PROFILE)
S = sizes(PROFILE, MOE_SIZES)
seed_everything(0)
torch.set_num_threads(1)
KiB = 1024

# %% [markdown]
# ## 9. A mixture of experts
#
# A transformer block spends most of its parameters and FLOPs in the MLP. A **mixture of experts** (MoE) replaces
# that one MLP by $E$ of them, the *experts*, and a **router**, a linear layer $W_r$ of shape $(h, E)$ that scores
# each token $x$ against every expert (Shazeer et al. 2017, ["Outrageously Large Neural Networks"](https://arxiv.org/abs/1701.06538)).
# The token goes to its $k$ best experts only, and their outputs are summed, weighted by the router's softmax:
#
# $$p(x) = \mathrm{softmax}(x W_r), \qquad y = \sum_{i \in \mathrm{top}_k(p(x))} g_i(x)\, \mathrm{MLP}_i(x),$$
#
# with the gate $g_i = p_i$ for $k = 1$ (Switch Transformer, Fedus et al. 2021, ["Switch Transformers"](https://arxiv.org/abs/2101.03961))
# and the two chosen probabilities renormalised to sum to 1 for $k = 2$ (GShard, Lepikhin et al. 2020,
# ["GShard"](https://arxiv.org/abs/2006.16668)). The parameters grow $E$-fold; the FLOPs per token grow $k$-fold.
#
# **Capacity.** To give the buffers that carry tokens to the experts a fixed size (section 11 sends them to other
# ranks), each expert accepts at most
#
# $$C = \left\lceil \text{capacity factor} \cdot \frac{k\,T}{E} \right\rceil$$
#
# of a batch's $T$ tokens (Switch, section 2.2). A choice beyond an expert's capacity is **dropped**: the layer adds
# nothing for it and the residual connection carries the token on. The choices queue slot-major, every token's
# first choice before any token's second (GShard), so an overflow costs second choices first. Sorting the choices
# by expert gives each its place in its expert's queue; `moe.dispatch_indices` does it with one stable sort:

# %%
print(inspect.getsource(moe.dispatch_indices))

# %% [markdown]
# The layer (`moe.MoEMLP`) gathers each expert's kept tokens, runs the expert on them as one batch, and scatters
# the gated outputs back with `index_add`. The same layer written token by token, a loop over tokens and their
# choices, must give the same output, float64:

# %%
E, MOE_D = S["moe_experts"], S["moe_d"]
moe_x, moe_y = moe.teacher_task(0, S["moe_tokens"], MOE_D)
moe_x64 = moe_x.double()
by_hand_diff, drops_seen, zero_when_dropped = {}, {}, {}
for k_ in (1, 2):
    for factor in (1.0, moe.no_drop_factor(E, k_)):
        torch.manual_seed(0)
        layer = moe.MoEMLP(MOE_D, 2 * MOE_D, E, k_, factor).double()
        with torch.no_grad():
            out = layer(moe_x64)
            r, n = layer.routing, moe_x64.shape[0]
            loop = torch.zeros_like(moe_x64)
            for t in range(n):
                for s in range(k_):
                    if r.kept[s * n + t]:
                        loop[t] += r.gate[t, s] * layer.experts[int(r.expert[t, s])](moe_x64[t])
        key = f"k={k_}, factor {factor:g}"
        by_hand_diff[key] = (out - loop).abs().max().item()
        drops_seen[key] = r.drop_rate()
        lost = [t for t in range(n) if not any(r.kept[s * n + t] for s in range(k_))]
        zero_when_dropped[key] = out[lost].abs().max().item() if lost else 0.0
        print(f"{key:18s}: capacity {r.capacity:4d}, dropped {r.drop_rate():6.1%} of the choices, "
              f"layer vs token by token {by_hand_diff[key]:.1e}, {len(lost)} tokens lost every choice")
record("ch11/moe_layer_vs_token_by_token", max(by_hand_diff.values()), "float64, k = 1, 2, with and without drops")
record("ch11/moe_drop_rate_untrained", drops_seen)
record("ch11/moe_output_of_dropped_tokens", max(zero_when_dropped.values()))

# %% [markdown]
# At capacity factor $E/k$ one expert could take every choice, so nothing is dropped; at 1 an untrained router
# already overflows some experts, and a token that lost every choice gets exactly zero from the layer.
#
# **How many are dropped?** The drop rate against the capacity factor, for the router as initialised, $k = 1$ and
# $k = 2$ (routing only: no expert needs to run to know what is dropped):

# %%
FACTORS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
torch.manual_seed(0)
router = torch.nn.Linear(MOE_D, E, bias=False)
with torch.no_grad():
    logits = router(moe_x)
drop_curve = {f"k={k_}": [moe.route(logits, k_, f).drop_rate() for f in FACTORS] for k_ in (1, 2)}
tokens_init = {f"k={k_}": moe.route(logits, k_, 1.0).tokens_per_expert().tolist() for k_ in (1, 2)}
for name, rates in drop_curve.items():
    print(f"{name}: " + ", ".join(f"{f:g}: {d:.1%}" for f, d in zip(FACTORS, rates)) + f"; tokens per expert {tokens_init[name]}")
record("ch11/moe_drop_vs_factor_init", {name: dict(zip(map(str, FACTORS), rates)) for name, rates in drop_curve.items()})
record("ch11/moe_tokens_per_expert_init", tokens_init)

# %% [markdown]
# Even at capacity factor 1, with room for exactly an even share, a random router drops a sizeable fraction: its
# loads are uneven. Training alone does not even them out: an expert that gets more tokens learns faster, scores
# higher, and keeps them, while an expert that gets few stops learning.
#
# ## 10. The load-balancing loss
#
# Switch (eq. 4) adds an auxiliary loss, weighted by a small $\alpha$, that is smallest when the load is even:
#
# $$\mathcal{L}_\text{aux} = E \sum_{i=1}^{E} f_i\, P_i, \qquad f_i = \frac{1}{T}\sum_x \mathbb{1}[\arg\max p(x) = i],
# \qquad P_i = \frac{1}{T} \sum_x p_i(x).$$
#
# $f_i$, the fraction of tokens whose first choice is expert $i$, has no gradient; $P_i$, the mean router
# probability, does, and the product steers probability away from the experts that are over-loaded. Both uniform
# gives $\mathcal{L}_\text{aux} = 1$; every token on one expert with all its probability gives $E$ (GShard's
# $\ell_\text{aux}$ is the same, with $P$ the mean gate):

# %%
print(inspect.getsource(moe.load_balancing_loss))
even = moe.load_balancing_loss(torch.full((8, E), 1 / E), torch.arange(8) % E).item()
onehot = torch.zeros(8, E)
onehot[:, 0] = 1.0
collapsed = moe.load_balancing_loss(onehot, torch.zeros(8, dtype=torch.long)).item()
print(f"even: {even:.3f}, collapsed on one expert: {collapsed:.3f} (E = {E})")
record("ch11/moe_aux_even_and_collapsed", {"even": even, "collapsed": collapsed, "E": E})

# %% [markdown]
# A short training run shows what it does: the layer learns a random teacher MLP on clustered tokens
# (`moe.teacher_task`), $k = 1$, capacity factor 1.25, with Adam, on several seeds, once without the auxiliary
# loss and once with weight $\alpha$ (the profile's `moe_aux`; Switch used $10^{-2}$ beside a language model's
# cross-entropy of a few nats; our task loss, a mean-squared error, is below 1 from the start, and $10^{-2}$ moves
# the load only part of the way in so short a run). The load is measured as the most-loaded expert's tokens over
# the mean (1 is even, $E$ is all on one expert):

# %%
seeds = list(range(S["moe_seeds"]))
runs = {alpha: [moe.balance_run(s, alpha, E, 1, MOE_D, S["moe_tokens"], S["moe_steps"], factors=FACTORS)
                for s in seeds] for alpha in (0.0, S["moe_aux"])}
balance = {}
for alpha, rs in runs.items():
    last = [r["imbalance"][-1] for r in rs]
    drops = [r["drop_rate"] for r in rs]
    loss = [r["loss"][1] for r in rs]
    # experts left with under a quarter of the even share: they hardly learn
    starved = [sum(t < S["moe_tokens"] / E / 4 for t in r["tokens_per_expert"]) for r in rs]
    balance[f"aux {alpha:g}"] = {"imbalance": last, "drop_rate": drops, "loss": loss, "starved": starved,
                                 "drop_vs_factor": [list(r["drop_vs_factor"].values()) for r in rs]}
    print(f"aux weight {alpha:<5g}: max/mean load after {S['moe_steps']} steps {statistics.mean(last):.2f} "
          f"(seeds {', '.join(f'{v:.2f}' for v in last)}), dropped at 1.25 {statistics.mean(drops):.1%} "
          f"(spread {min(drops):.1%}-{max(drops):.1%}), starved experts {starved}, task loss {statistics.mean(loss):.3f} "
          f"(spread {min(loss):.3f}-{max(loss):.3f})")
record("ch11/moe_balance", balance, f"k = 1, E = {E}, capacity factor 1.25, {len(seeds)} seeds")
record("ch11/moe_balance_seeds", len(seeds))
record("ch11/moe_imbalance_at_start", [r["imbalance"][0] for r in runs[0.0]])
fig = plots.curves({"initial router, k=1": (FACTORS, drop_curve["k=1"]),
                    "initial router, k=2": (FACTORS, drop_curve["k=2"]),
                    "trained, k=1, no aux": (FACTORS, runs[0.0][0]["drop_vs_factor"].values()),
                    f"trained, k=1, aux {S['moe_aux']:g}": (FACTORS, runs[S["moe_aux"]][0]["drop_vs_factor"].values())},
                   f"Dropped choices against capacity, E = {E}, seed 0", "capacity factor", "fraction dropped")
plots.save(fig, "ch11_moe_drop_rate")

# %%
fig = plots.curves({f"aux {alpha:g}": (list(range(E)), rs[0]["tokens_per_expert"]) for alpha, rs in runs.items()}
                   | {"even share": (list(range(E)), [S["moe_tokens"] / E] * E),
                      "capacity (factor 1.25)": (list(range(E)), [moe.expert_capacity(S["moe_tokens"], E, 1.25)] * E)},
                   f"Tokens per expert after {S['moe_steps']} steps, seed 0", "expert", "tokens")
plots.save(fig, "ch11_moe_tokens_per_expert")
record("ch11/moe_tokens_per_expert_trained", {f"aux {alpha:g}": rs[0]["tokens_per_expert"] for alpha, rs in runs.items()})

# %% [markdown]
# Without the auxiliary loss the router piles tokens onto a few experts and leaves others starved, and a capacity
# of 1.25 times the even share drops a large fraction of the tokens; with it the load is close to even, almost
# nothing is dropped, and the task loss is lower too: a dropped token is a token the layer does not learn from,
# and a starved expert is parameters that do not learn. The drop-rate curves tell the
# trade: a larger capacity factor drops less but makes every buffer (and, section 11, every message) larger.
#
# ## 11. Experts on different ranks
#
# $E$ experts are $E$ times an MLP's parameters: too many for one device in a large model. **Expert parallelism**
# (GShard) puts $E/e$ experts on each of $e$ ranks and keeps everything else (router, attention, norms) replicated,
# as in data parallelism: each rank brings its own tokens. A layer on rank $r$:
#
# 1. routes its $T_r$ tokens (the router is the same everywhere) and sorts its kept choices by expert, so by the
#    rank that holds the expert;
# 2. **exchanges counts**: an all-to-all of the per-expert counts, $E/e$ to each rank, so that every rank knows
#    how many rows arrive from each other rank. The splits are uneven, decided by the router;
# 3. **dispatches**: `all_to_all_single` with those splits sends the token rows to their experts' ranks;
# 4. runs its experts on what arrived (regrouped by expert);
# 5. **combines**: the reverse all-to-all, splits swapped, brings every output row home, where it is gated and summed
#    per token as in one process.
#
# The backward of an all-to-all is the all-to-all with the splits swapped (`_AllToAll` below). Every token of the
# world reaches its expert, so the experts' gradients come out complete; the router's are partial sums over each
# rank's tokens and are all-reduced, as chapter 06's gradients are.

# %%
print(inspect.getsource(ep._AllToAll))
print(inspect.getsource(ep.ExpertParallelMoE.forward))

# %% [markdown]
# The worker `course_lib.workers.ep_compare` builds the same `MoEMLP` on every rank (same seed, float64), gives each
# rank its own tokens, runs the layer at a capacity that drops nothing ($E/k$), and compares outputs and gradients
# with the one-process layer on all the world's tokens. One launch on 2 ranks (also a run at capacity factor 1.25,
# and one through torch's differentiable `torch.distributed.nn.functional.all_to_all_single`), one on 4 ranks as
# $4 \times 1$ (EP over all four) and $2 \times 2$ (section 12):

# %%
EP_DROP_FACTOR = 1.25
EP_ARGS = ["--experts", str(E), "--d-model", str(S["ep_d"]), "--hidden", str(S["ep_hidden"]),
           "--tokens", str(S["ep_tokens"])]
start = time.perf_counter()
ep_reps = {2: EPReport.from_dict(launch.run("course_lib.workers.ep_compare", 2,
                                            EP_ARGS + ["--drop-factor", str(EP_DROP_FACTOR), "--api"], timeout=S["ep_timeout"])),
           4: EPReport.from_dict(launch.run("course_lib.workers.ep_compare", 4,
                                            EP_ARGS + ["--layouts", "4x1,2x2"], timeout=S["ep_timeout"]))}
print(f"two launches (2 and 4 ranks) in {time.perf_counter() - start:.0f} s")
no_drop = [r for rep in ep_reps.values() for r in rep.runs if r.capacity_factor == moe.no_drop_factor(E, r.k)]
print(f"{'ranks':>5s} {'e x d':>5s} {'k':>2s} {'all-to-all':>10s} {'output':>9s} {'input grad':>10s} {'router grad':>11s} {'expert grads':>12s}")
for r in no_drop:
    print(f"{r.ep * r.dp:5d} {r.ep:>3d}x{r.dp:<1d} {r.k:2d} {r.a2a:>10s} {r.out_diff:9.1e} {r.input_grad_diff:10.1e} "
          f"{r.router_grad_diff:11.1e} {r.expert_grad_diff:12.1e}")
record("ch11/ep_max_diff_float64", max(max(r.out_diff, r.input_grad_diff, r.router_grad_diff, r.expert_grad_diff)
                                       for r in no_drop), "2 and 4 ranks, k = 1, 2, 4x1 and 2x2, by hand and torch's")
record("ch11/ep_runs", sorted({f"{r.ep}x{r.dp}/k={r.k}/{r.a2a}" for r in no_drop}))

# %% [markdown]
# Equal to float64 rounding, on 2 and 4 ranks, through the hand-written all-to-all and through torch's.
#
# **Bytes per rank per layer.** A rank sends the rows bound for other ranks: under even routing $\frac{e-1}{e} k T_r$
# rows of $h$ elements of $b$ bytes, in each of four all-to-alls (dispatch, combine, and their backwards), plus the
# counts, $\frac{e-1}{e} E$ integers:
#
# $$\text{bytes per rank per layer} = 4\,\frac{e-1}{e}\,k\,T_r\,h\,b \;+\; \frac{e-1}{e}\,E \cdot 8 .$$
#
# The hand-written all-to-all adds to a `ByteCounter` the rows it sends to other ranks (`ep.all_to_all`). Against the
# rows that really crossed ranks (which the router decides) the count is exact; against the even-routing formula it
# is off by the router's imbalance:

# %%
exact, even_ratio, counts_ratio = {}, {}, {}
for r in no_drop:
    if r.a2a != "by_hand":
        continue
    key = f"{r.ep}x{r.dp}/k={r.k}"
    exact[key] = max(s / (2 * sum(off) * r.row_bytes) for s, off in zip(r.sent, r.off_rank_rows))
    formula = ep.bytes_per_layer(r.tokens_per_rank, S["ep_d"], r.k, r.ep, elem_bytes=8)
    even_ratio[key] = [s / formula for s in r.sent]
    counts_ratio[key] = max(r.sent_counts) / ((r.ep - 1) / r.ep * E * 8)
    print(f"{key:9s}: sent per rank {[round(s / KiB, 1) for s in r.sent]} KiB; formula {formula / KiB:.1f} KiB "
          f"(measured / formula {min(even_ratio[key]):.2f}-{max(even_ratio[key]):.2f}); counts {max(r.sent_counts):.0f} B")
record("ch11/ep_sent_over_rows_crossed", exact, "largest rank; 2 x (dispatched + received off-rank rows) x row bytes")
record("ch11/ep_sent_over_even_formula", even_ratio, "per rank; float64")
record("ch11/ep_counts_over_formula", counts_ratio)

# %% [markdown]
# **Parameters per rank.** The router's $hE$ on every rank, and $E/e$ experts of $2h h_\text{mlp} + h_\text{mlp} + h$:

# %%
params_ratio, expert_share = {}, {}
full_experts = ep.params_per_rank(S["ep_d"], S["ep_hidden"], E, 1)["experts"]
for r in no_drop:
    want = ep.params_per_rank(S["ep_d"], S["ep_hidden"], E, r.ep)
    key = f"{r.ep}x{r.dp}"
    params_ratio[key] = max(p[part] / want[part] for p in r.params for part in want)
    expert_share[key] = r.params[0]["experts"] / full_experts
print({key: f"experts {share:.3f} of all, measured / formula {params_ratio[key]:.3f}" for key, share in expert_share.items()})
record("ch11/ep_params_over_formula", params_ratio)
record("ch11/ep_expert_share_per_rank", expert_share)

# %% [markdown]
# **The dispatch buffers.** The rows a rank sends and receives are activations the layer holds (the received rows
# are the experts' inputs, saved for the backward). With routing as it falls they are about $k T_r$ rows each way;
# an implementation with fixed shapes (as on GPUs, to avoid a host synchronisation on the counts) pads every
# expert's slot to the capacity, $E \cdot C \approx \text{capacity factor} \cdot k\,T_r$ rows: the capacity
# factor's price in memory. At capacity factor 1.25 on 2 ranks:

# %%
buffers = {}
for k_ in (1, 2):
    r = ep_reps[2].run(2, 1, k_, dropping=True)
    padded = E * r.capacity[0]
    buffers[f"k={k_}"] = {"send_rows": r.send_rows, "recv_rows": r.recv_rows, "even_rows": k_ * r.tokens_per_rank,
                          "padded_rows": padded, "drop_rate": r.drop_rate, "row_bytes": r.row_bytes,
                          "recv_kib": [rows * r.row_bytes / KiB for rows in r.recv_rows],
                          "padded_kib": ep.dispatch_buffer_bytes(r.tokens_per_rank, S["ep_d"], k_, EP_DROP_FACTOR, 8) / KiB}
    print(f"k={k_}: rows sent {r.send_rows}, received {r.recv_rows} (even routing {k_ * r.tokens_per_rank}, padded "
          f"to capacity {padded}); dropped {[f'{d:.0%}' for d in r.drop_rate]}")
record("ch11/ep_dispatch_buffers", buffers, f"2 ranks, capacity factor {EP_DROP_FACTOR}, float64")
record("ch11/ep_dispatch_factor", EP_DROP_FACTOR)

# %% [markdown]
# The rows a rank receives vary from rank to rank (the routers decide), never past the padded size $E \cdot C$: no
# rank sends more than $C$ rows to one expert. Fixed shapes cost the padding; variable ones, the counts exchange and
# its wait.
#
# ## 12. Experts and data parallelism on the same ranks
#
# With $e$ smaller than the world, $e \times d$ ranks form $d$ expert-parallel groups of $e$ consecutive ranks; the
# ranks that hold the same experts (one in each group) form a data-parallel group. On 4 ranks as $2 \times 2$:
# EP groups $\{0, 1\}, \{2, 3\}$, DP groups $\{0, 2\}, \{1, 3\}$. Tokens travel only inside an EP group; each
# expert's gradient is then a partial sum over its EP group's tokens and is all-reduced over its DP group only,
# the router's over all ranks:
#
# $$\text{gradient bytes per rank} = 2\frac{N-1}{N} P_\text{router} b + 2\frac{d-1}{d} \frac{E}{e} P_\text{expert} b.$$

# %%
print("EP groups, DP groups on 4 ranks as 2x2:", ep.expert_dp_groups(4, 2))
sync_ratio = {}
for r in no_drop:
    if r.a2a != "by_hand":
        continue
    world = r.ep * r.dp
    want = ep.params_per_rank(S["ep_d"], S["ep_hidden"], E, r.ep)
    formula = 2 * (world - 1) / world * 8 * want["router"] + 2 * (r.dp - 1) / r.dp * 8 * want["experts"]
    sync_ratio[f"{r.ep}x{r.dp}/k={r.k}"] = max(g["all_reduce"] for g in r.grad_sync) / formula
    print(f"{r.ep}x{r.dp}, k={r.k}: gradient all-reduce {max(g['all_reduce'] for g in r.grad_sync) / KiB:.1f} KiB per rank "
          f"(formula {formula / KiB:.1f})")
record("ch11/ep_grad_sync_over_formula", sync_ratio)

# %% [markdown]
# $4 \times 1$ holds a quarter of the experts per rank and sends its tokens to three other ranks; $2 \times 2$ holds
# half, sends to one, and pays an all-reduce of its experts' gradients over its DP partner. Which is better depends
# on what is short: memory (more EP) or the all-to-all's bandwidth, which crosses the slow links once the EP group
# spans nodes (more DP). The all-to-all's bytes grow with the tokens, $k$ and $h$; the DP all-reduce's with the
# experts' parameters.
#
# **Bad input** gets a clear error:

# %%
bad = {}
for name, call in {"capacity factor 0": lambda: moe.MoEMLP(8, 16, 4, capacity_factor=0.0),
                   "more experts than tokens": lambda: moe.MoEMLP(8, 16, 4)(torch.randn(3, 8)),
                   "3 ranks for 8 experts": lambda: ep.experts_per_rank(8, 3)}.items():
    try:
        call()
        bad[name] = None
    except ValueError as exc:
        bad[name] = str(exc)
    print(f"{name}: {bad[name]}")
record("ch11/moe_bad_input", bad)
