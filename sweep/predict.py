"""Prediction: a simulated rank's measured compute, plus its counted bytes on a modelled
wire. A pipeline's ranks are replayed in their schedule's order; the others' step is
their compute with their communication hidden (the fast end) or exposed (the slow end)."""

import common
import pipeline_train
from sweep.lines import base_strategy


# Achievable bus bandwidth per GPU, GB/s: (inside a node over NVLink, across nodes over the
# network). nccl-tests' all_reduce_perf at large sizes reaches 460-480 GB/s on 8x H100 SXM
# and 230-250 on 8x A100 SXM (Alaya NeW, "NCCL-tests in practice", 2026); two H200 nodes
# on 4x ConnectX-7 RoCE peak near 35 GB/s (kubernetes.recipes, "NCCL all-reduce
# benchmarking on multi-node GPUs"). The low end of each, not the datasheet's peak.
LINK_GBPS = [("H200", (460, 35)), ("H100", (460, 35)), ("A100", (230, 35))]
# Where a GPU is not listed, or on the CPU fallback: H200's figures, said so in the table.
DEFAULT_LINK = ("H200", (460, 35))
P2P = ("send", "recv")


def link_bandwidth(gpu_name, intra_gbps=None, inter_gbps=None):
    """(intra-node GB/s, inter-node GB/s, where they come from) for this GPU."""
    key, (intra, inter) = next(((k, v) for k, v in LINK_GBPS if gpu_name and k in gpu_name and "PCIe" not in gpu_name), DEFAULT_LINK)
    source = f"{key} nccl-tests figures" if gpu_name and key in gpu_name else f"{key}'s figures: {gpu_name or 'no GPU here'} is not in LINK_GBPS"
    if intra_gbps is not None or inter_gbps is not None:
        source = "as given"
    return intra if intra_gbps is None else intra_gbps, inter if inter_gbps is None else inter_gbps, source


def wire_bytes(entry):
    """Bytes one counted entry (all its calls) puts on the wire per rank with ring
    algorithms: an all-reduce 2(n-1)/n of its buffer, an all-gather or reduce-scatter
    (n-1)/n, a transfer its message."""
    n = entry["group_size"]
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n}.get(entry["kind"], 1.0 if n > 1 else 0.0)
    return factor * entry["bytes"]


def comm_seconds(entry, bandwidth):
    """Time on the wire of one counted entry: its wire_bytes at bandwidth = (intra GB/s,
    inter GB/s, GPUs per node); a group whose ranks sit on more than one node runs at the
    slower figure. Latency is left out: the smallest messages here are megabytes on the
    GPU presets."""
    intra, inter, per_node = bandwidth
    nodes = {rank // per_node for rank in entry["group"]}
    return wire_bytes(entry) / ((inter if len(nodes) > 1 else intra) * 1e9)


def _action(text):
    kind, rest = text[0], text[1:]
    stage, micro = rest.split(":")
    return kind, int(stage), int(micro)


def replay(orders, compute, transfer, blocking=False):
    """Run each pipeline rank's actions in its schedule's order ({rank: ["F0:0", ...]}),
    each as soon as its rank is free and its input has arrived: a forward needs the
    previous stage's forward of that micro-batch, a backward (B, or zero-bubble's input
    half I) the next stage's, the last stage's backward its own forward, a weight
    gradient W its input half. compute(rank, kind, stage) and transfer(from_rank,
    to_rank) give seconds; with blocking, a transfer also keeps its sender busy. Returns
    (makespan, {rank: busy seconds})."""
    actions = {r: [_action(a) for a in order] for r, order in orders.items()}
    rank_of = {stage: r for r, acts in actions.items() for _, stage, _ in acts}
    last_stage = max(rank_of)
    done, clock, busy, position = {}, dict.fromkeys(actions, 0.0), dict.fromkeys(actions, 0.0), dict.fromkeys(actions, 0)

    def needs(kind, stage, micro):
        if kind == "F":
            return [("F", stage - 1, micro)] if stage > 0 else []
        if kind == "W":
            return [("I", stage, micro)]
        if stage == last_stage:
            return [("F", stage, micro)]
        return [("B", stage + 1, micro), ("I", stage + 1, micro)]  # whichever that stage ran

    while any(position[r] < len(actions[r]) for r in actions):
        moved = False
        for r in actions:
            while position[r] < len(actions[r]):
                kind, stage, micro = actions[r][position[r]]
                inputs = [(key, done[key]) for key in needs(kind, stage, micro) if key in done]
                if needs(kind, stage, micro) and not inputs:
                    break  # its input is not computed yet: another rank moves first
                ready = 0.0
                for (_, from_stage, _), end in inputs:
                    ready = max(ready, end + (transfer(rank_of[from_stage], r) if rank_of[from_stage] != r else 0.0))
                seconds = compute(r, kind, stage)
                start = max(clock[r], ready)
                done[(kind, stage, micro)] = start + seconds
                clock[r], busy[r] = start + seconds, busy[r] + seconds
                sends_to = rank_of.get(stage + 1) if kind == "F" else rank_of.get(stage - 1) if kind in "BI" else None
                if blocking and sends_to is not None and sends_to != r:
                    clock[r] += transfer(r, sends_to)
                position[r] += 1
                moved = True
        if not moved:
            raise ValueError(f"the orders wait on each other: {orders}")
    return max(clock.values()), busy


def roles(strategy, n, n_layers, schedule="1f1b", stages_per_rank=1, pp=2):
    """{rank to simulate: the ranks of an n-rank run it stands for}. Ranks whose work is
    the same are one role: a pipeline rank's work is its stages' blocks and whether it
    holds the first stage (the embedding) or the last (the head), its stages placed as
    the schedule places them; model parallel is a pipeline of one part per rank without
    micro-batches; hybrid a pipeline of pp ranks, each replicated over n/pp (mesh pp-dp:
    pipeline rank k's replicas are global ranks k*dp to k*dp+dp-1). The others' ranks
    all do the same work."""
    if strategy not in ("pipeline", "model_parallel", "hybrid"):
        return {0: list(range(n))}
    pp = pp if strategy == "hybrid" else n
    dp = n // pp
    per_rank = 1 if strategy == "model_parallel" else stages_per_rank
    n_stages = pp * per_rank
    blocks = [n_layers // n_stages + (i < n_layers % n_stages) for i in range(n_stages)]
    by_work = {}
    for k in range(pp):
        stages = pipeline_train.stages_of_rank(schedule, k, pp, per_rank)
        work = (tuple(blocks[s] for s in stages), 0 in stages, n_stages - 1 in stages)
        by_work.setdefault(work, []).extend(range(k * dp, (k + 1) * dp))
    return {ranks[0]: ranks for ranks in by_work.values()}


def roles_of(run):
    """roles() of the run a simulated rank's line belongs to."""
    config = run["config"]
    pp = run.get("mesh", {}).get("pp", config.get("pp", 2))
    return roles(base_strategy(run["strategy"]), run["world_size"], common.PRESETS[run["model"]].n_layers, config.get("schedule", "1f1b"),
                 config.get("stages_per_rank") or 1, pp)


# A step's parts, as step_split() gives them, in the order the report lists them.
SPLIT_PARTS = ("data", "compute", "comm", "bubble", "optimizer", "rest")


def step_split(run):
    """A run's mean timed step in the report's parts, from what its results line measured
    (common.StepClock, averaged over ranks): the waits for data; compute (forward,
    backward, clipping); exposed communication (measured apart by ddp_train.py at 2+
    GPUs, nothing at one, else None: it sits in compute); the pipeline bubble (where the
    ranks timed their compute, pipelines and model parallel: what the span before the
    optimizer holds beyond it, waiting on other stages and their transfers; else None);
    the optimizer step; the rest (zero_grad, the loss all-reduce, the step's end). None
    for a line without the measurements."""
    measured = run.get("step_parts_seconds")
    if measured is None:
        return None
    step, data, optimizer = run["step_seconds"], measured["data"], measured["optimizer"]
    comm = 0.0 if run["world_size"] == 1 else run.get("comm_seconds")
    work = max(0.0, measured["to_optimizer"] - data - (comm or 0.0))
    if run.get("utilisation_pct") is None:
        compute, bubble = work, None
    else:  # the ranks' busy share of a step holds their optimizer step too
        compute = max(0.0, run["utilisation_pct"] / 100 * step - optimizer)
        bubble = max(0.0, work - compute)
    parts = {"data": data, "compute": compute, "comm": comm, "bubble": bubble, "optimizer": optimizer}
    return {**parts, "rest": max(0.0, step - sum(v for v in parts.values() if v is not None))}


def predict(runs, bandwidth):
    """One predicted row from the simulated ranks of one (strategy, world, batch run):
    its step time as a range (low: communication hidden wherever the strategy overlaps
    it; high: all of it exposed), with the communication's share of each end, for
    pipelines the bubble of the replayed schedule, and the low end's step split into
    the parts of step_split (None where a rank's line has no parts)."""
    first = runs[0]
    n, strategy, config = first["world_size"], base_strategy(first["strategy"]), first["config"]
    by_rank = {r["simulated_rank"]: r for r in runs}
    role_of = {rank: role for role, ranks in roles_of(first).items() for rank in ranks}

    def wire(run, keep):
        return sum(comm_seconds(e, bandwidth) for e in run["comm_per_step"] if keep(e))

    if strategy not in ("pipeline", "hybrid", "model_parallel"):
        run = by_rank[0]
        compute = run["step_seconds"]
        tp_group = list(range(run["mesh"]["tp"])) if strategy == "tp" else None
        critical = wire(run, lambda e: e["group"] == tp_group)  # each TP all-reduce waits for the block before it
        overlapped = wire(run, lambda e: e["group"] != tp_group and e["kind"] != "recv")  # a receive is the peer's send
        low, high = max(compute, overlapped) + critical, compute + overlapped + critical
        measured = step_split(run)  # the rank's own parts: its communication only counted, so none among them
        split = None if measured is None else {**measured, "comm": low - compute}
        return {"low": low, "high": high, "bubble_pct": None, "comm_pct": (100 * (1 - compute / low), 100 * (1 - compute / high)),
                "split": split, "runs": runs}

    if strategy == "model_parallel":  # every micro-step: forward through every rank, then backward
        orders = {r: [f"{kind}{r}:{i}" for i in range(config["grad_accum"]) for kind in "FB"] for r in range(n)}
        repeats, dp = 1, 1
    else:  # one schedule step per micro-step of accumulation
        orders = {int(r): actions for r, actions in first["pipeline_order"].items()}
        repeats, dp = config["grad_accum"], first["mesh"]["dp"] if strategy == "hybrid" else 1
    run_of = {k: by_rank[role_of[k * dp]] for k in orders}  # pipeline rank k's first replica is global rank k * dp
    message = max((e["bytes"] / e["calls"] for r in runs for e in r["comm_per_step"] if e["kind"] == "send"), default=0)

    def transfer(a, b):
        across = (a * dp) // bandwidth[2] != (b * dp) // bandwidth[2]
        return message / ((bandwidth[1] if across else bandwidth[0]) * 1e9)

    def compute(k, kind, stage):
        return run_of[k]["action_seconds"][kind]

    free, busy = replay(orders, compute, lambda a, b: 0.0)
    delayed, _ = replay(orders, compute, transfer)
    blocked, _ = replay(orders, compute, transfer, blocking=True)
    # What a rank spends outside its timed actions even with no peer to wait for, and its optimizer step.
    slowest = max(orders, key=lambda k: run_of[k]["step_seconds"] - repeats * busy[k])
    fixed = run_of[slowest]["step_seconds"] - repeats * busy[slowest]
    # Gradient reduction over the replicas, clipping's all-reduce: hidden at best, exposed at worst.
    rest = max(wire(r, lambda e: e["kind"] not in P2P) for r in runs)
    base = repeats * free + fixed
    low, high = repeats * delayed + fixed, repeats * blocked + fixed + rest
    # The low end's parts: the ranks' mean compute, the replayed schedule's idle, the
    # transfers' delay, and the slowest rank's time outside its actions.
    measured, split = run_of[slowest].get("step_parts_seconds"), None
    if measured is not None:
        compute_seconds = repeats * sum(busy.values()) / len(busy)
        split = {"data": measured["data"], "compute": compute_seconds, "comm": low - base, "bubble": repeats * free - compute_seconds,
                 "optimizer": measured["optimizer"], "rest": max(0.0, fixed - measured["data"] - measured["optimizer"])}
    return {"low": low, "high": high, "bubble_pct": 100 * (1 - sum(busy.values()) / len(busy) / free),
            "comm_pct": (100 * (1 - base / low), 100 * (1 - base / high)), "split": split, "runs": runs}
