"""The sweep's comparison table, and a speedup plot where matplotlib is installed, from
the lines its runs wrote: results.jsonl (one per finished run), simulated.jsonl (one per
simulated rank, run_all.sh --simulate) and failures.jsonl (one per failed run, written by
run_all.sh). Predicted rows turn each simulated rank's measured compute and counted
bytes into a step time on a modelled wire.

    python3 sweep_report.py OUT [--intra-gbps X] [--inter-gbps Y] [--gpus-per-node K]
    python3 sweep_report.py --roles MODEL STRATEGY:N ...   # the ranks a simulation runs"""

import argparse
import json
import os

from tabulate import tabulate

import common

# The article's order; strategies it does not have come after it, by name.
ORDER = ["ddp", "model_parallel", "pipeline", "hybrid", "fsdp", "tp"]
# Failure lines name the script; tensor_parallel_train.py's records say "tp".
STRATEGY_OF_SCRIPT = {"tensor_parallel": "tp"}
HEADERS = ["strategy", "GPUs", "global batch", "samples/s", "speedup", "efficiency", "MFU", "peak GiB (%)", "overhead %", "measured vs predicted"]
PREDICTED = " (predicted)"


def read_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load(out_dir):
    """(records, failures, simulated ranks, their failures) of one sweep, failures under
    their records' strategy names."""
    records = [named(r) for r in read_lines(os.path.join(out_dir, "results.jsonl"))]
    simulated = [named(r) for r in read_lines(os.path.join(out_dir, "simulated.jsonl"))]
    failures = [named({**f, "strategy": STRATEGY_OF_SCRIPT.get(f["strategy"], f["strategy"])})
                for f in read_lines(os.path.join(out_dir, "failures.jsonl"))]
    return records, [f for f in failures if not f.get("simulated")], simulated, [f for f in failures if f.get("simulated")]


def named(run):
    """A float8 run (run_all.sh --float8) is a row of its own, named after its strategy."""
    mode = run.get("config", run).get("float8")
    return {**run, "strategy": f"{run['strategy']} float8 {mode}"} if mode else run


def run_key(run):
    return run["strategy"], run["world_size"], run["global_batch_size"]


def latest(runs, key=run_key):
    """One run per key. The files are only appended to, so of a run that appears twice
    the later line is the newer, and it replaces the other."""
    return list({key(run): run for run in runs}.values())


def is_baseline_run(run):
    return run["strategy"] == "ddp" and run["world_size"] == 1


def baseline(records):
    """The single-GPU baseline: the (newest) ddp record at world size 1, or None."""
    return next((r for r in reversed(records) if is_baseline_run(r)), None)


def speedup(record, base):
    """samples/s over the baseline's; None without a baseline."""
    return None if base is None else record["samples_per_sec"] / base["samples_per_sec"]


def overhead(record):
    """What keeps this strategy from scaling, as it measured it."""
    if record.get("comm_pct") is not None:
        return f"comm {record['comm_pct']:.1f}"
    if record.get("bubble_pct") is not None:
        return f"bubble {record['bubble_pct']:.1f}"
    if record.get("utilisation_pct") is not None:
        return f"idle {100 - record['utilisation_pct']:.1f}"
    return "-"


def shown(records, failures):
    """The runs the table shows: each once, by its newest line; a run with a failure line
    only as failed, even if it wrote figures before it failed."""
    failures = latest(failures)
    failed = {run_key(f) for f in failures}
    return [r for r in latest(records) if run_key(r) not in failed], failures


def predictions(simulated, sim_failures, bandwidth):
    """{run key: predicted row (see predict) or the failure that stopped one of its ranks}."""
    groups = {}
    for run in latest(simulated, key=lambda r: (*run_key(r), r["simulated_rank"])):
        groups.setdefault(run_key(run), []).append(run)
    out = {key: predict(runs, bandwidth) for key, runs in groups.items()}
    for f in latest(sim_failures, key=lambda f: (*run_key(f), f.get("simulated_rank"))):
        out[run_key(f)] = f
    return out


def bracket(low, high, fmt, unit=""):
    """One cell for a range; a single figure where both ends round alike."""
    a, b = fmt.format(low), fmt.format(high)
    return f"{a}{unit}" if a == b else f"{a}-{b}{unit}"


def predicted_cells(p, base):
    """A predicted row's cells, from GPUs on: slow end first."""
    run = p["runs"][0]
    batch, n = run["global_batch_size"], run["world_size"]
    rates = (batch / p["high"], batch / p["low"])
    mem_gib = max(r["peak_mem_gib"] for r in p["runs"])
    mem_pct = max(r["mem_pct"] for r in p["runs"])
    mfu = None if run["mfu"] is None else [run["mfu"] * run["step_seconds"] / s for s in (p["high"], p["low"])]
    share = bracket(*p["comm_pct"], "{:.1f}")
    cells = [n, batch, bracket(*rates, "{:.2f}")]
    if base is None:
        cells += ["-", "-"]
    else:
        gains = [rate / base["samples_per_sec"] for rate in rates]
        cells += [bracket(*gains, "{:.2f}", "x"), bracket(*(100 * g / n for g in gains), "{:.0f}", "%")]
    cells += ["-" if mfu is None else bracket(*mfu, "{:.1f}", "%"),
              f"{mem_gib:.2f} ({mem_pct:.0f}%)" + (" does not fit" if mem_pct > 100 else ""),
              f"comm {share}" + ("" if p["bubble_pct"] is None else f", bubble {p['bubble_pct']:.1f}"), "-"]
    return cells


def against_prediction(record, p):
    """Where a measured row falls against its prediction's range of samples/s."""
    if p is None or "error" in p:
        return "-"
    slow, fast = (record["global_batch_size"] / p[end] for end in ("high", "low"))
    rate = record["samples_per_sec"]
    if slow <= rate <= fast:
        return "within"
    return f"{100 * (rate / fast - 1):+.0f}% above" if rate > fast else f"{100 * (rate / slow - 1):+.0f}% below"


def table_rows(records, failures, simulated=(), sim_failures=(), bandwidth=None):
    """The table's rows (lists of cells, as HEADERS), in the article's order, each
    predicted row after the measured one of the same run where there is one."""
    records, failures = shown(records, failures)
    base = baseline(records)
    predicted = predictions(simulated, sim_failures, bandwidth) if simulated or sim_failures else {}

    def name(run):
        return "single-GPU baseline" if is_baseline_run(run) else run["strategy"]

    rows = []
    for r in records:
        s = speedup(r, base)
        rows.append(((*run_key(r), 0), [name(r), r["world_size"], r["global_batch_size"], f"{r['samples_per_sec']:.2f}",
                                        "-" if s is None else f"{s:.2f}x",
                                        "-" if s is None else f"{100 * s / r['world_size']:.0f}%",
                                        "-" if r["mfu"] is None else f"{r['mfu']:.1f}%",
                                        f"{r['peak_mem_gib']:.2f} ({r['mem_pct']:.0f}%)", overhead(r),
                                        against_prediction(r, predicted.get(run_key(r)))]))
    for f in failures:
        rows.append(((*run_key(f), 0), [name(f), f["world_size"], f["global_batch_size"], f"failed: {f['error'][:60]}", *["-"] * 6]))
    for key, p in predicted.items():
        if "error" in p:
            fits = "out of memory" not in p["error"].lower()
            why = f"rank {p['simulated_rank']}: {p['error'][:50]}" if fits else f"does not fit: rank {p['simulated_rank']} ran out of memory"
            rows.append(((*key, 1), [key[0] + PREDICTED, key[1], key[2], why, *["-"] * 6]))
        else:
            rows.append(((*key, 1), [key[0] + PREDICTED, *predicted_cells(p, base)]))

    def order(pair):
        (strategy, world_size, batch, is_prediction), _ = pair
        base_name = strategy.split(" float8")[0]  # float8 rows right after their strategy's
        rank = ORDER.index(base_name) if base_name in ORDER else len(ORDER)
        return rank, strategy, world_size, batch, is_prediction

    return [[str(cell) for cell in row] for _, row in sorted(rows, key=order)]


def plot_speedup(records, failures, path):
    """Speedup against GPUs per strategy, with the ideal line; False where there is no
    baseline or no matplotlib."""
    records, _ = shown(records, failures)
    base = baseline(records)
    if base is None:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    counts = sorted({r["world_size"] for r in records})
    ax.plot(counts, counts, "k--", label="ideal")
    for strategy in ORDER:
        points = sorted((r["world_size"], speedup(r, base)) for r in records if r["strategy"] == strategy)
        if points:
            ax.plot(*zip(*points), "o-", label=strategy)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup over 1 GPU")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return True


# ----------------------------------------------------------------------------
# Prediction: a simulated rank's measured compute, plus its counted bytes on a modelled wire
# ----------------------------------------------------------------------------

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
    if intra_gbps or inter_gbps:
        source = "as given"
    return intra_gbps or intra, inter_gbps or inter, source


def comm_seconds(entry, bandwidth):
    """Time on the wire of one counted entry (all its calls) with ring algorithms: an
    all-reduce moves 2(n-1)/n of its buffer per rank, an all-gather or reduce-scatter
    (n-1)/n, a transfer its message. bandwidth = (intra GB/s, inter GB/s, GPUs per node);
    a group whose ranks sit on more than one node runs at the slower figure. Latency is
    left out: the smallest messages here are megabytes on the GPU presets."""
    intra, inter, per_node = bandwidth
    n = entry["group_size"]
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n}.get(entry["kind"], 1.0 if n > 1 else 0.0)
    nodes = {rank // per_node for rank in entry["group"]}
    return factor * entry["bytes"] / ((inter if len(nodes) > 1 else intra) * 1e9)


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


def roles(strategy, n, n_layers):
    """{rank to simulate: the ranks of an n-rank run it stands for}, for the sweep's plans
    (run_all.sh: pipelines of one stage per rank, hybrid as 2 stages x n/2 replicas).
    Ranks whose work is the same (a pipeline's middle stages of equal size) are one role."""
    if strategy in ("pipeline", "model_parallel"):
        counts = [n_layers // n + (i < n_layers % n) for i in range(n)]
        by_role = {}
        for rank in range(n):
            by_role.setdefault((counts[rank], rank == 0, rank == n - 1), []).append(rank)
        return {ranks[0]: ranks for ranks in by_role.values()}
    if strategy == "hybrid":  # mesh pp-dp: pipeline rank k's first replica is global rank k * dp
        dp = n // 2
        return {0: list(range(dp)), dp: list(range(dp, n))}
    return {0: list(range(n))}


def predict(runs, bandwidth):
    """One predicted row from the simulated ranks of one (strategy, world, batch run):
    its step time as a range (low: communication hidden wherever the strategy overlaps
    it; high: all of it exposed), with the communication's share of each end and, for
    pipelines, the bubble of the replayed schedule."""
    first = runs[0]
    n, strategy, config = first["world_size"], first["strategy"], first["config"]
    by_rank = {r["simulated_rank"]: r for r in runs}
    role_of = {rank: role for role, ranks in roles(strategy, n, common.PRESETS[first["model"]].n_layers).items() for rank in ranks}

    def wire(run, keep):
        return sum(comm_seconds(e, bandwidth) for e in run["comm_per_step"] if keep(e))

    if strategy not in ("pipeline", "hybrid", "model_parallel"):
        run = by_rank[0]
        compute = run["step_seconds"]
        tp_group = list(range(run["mesh"]["tp"])) if strategy == "tp" else None
        critical = wire(run, lambda e: e["group"] == tp_group)  # each TP all-reduce waits for the block before it
        overlapped = wire(run, lambda e: e["group"] != tp_group and e["kind"] != "recv")  # a receive is the peer's send
        low, high = max(compute, overlapped) + critical, compute + overlapped + critical
        return {"low": low, "high": high, "bubble_pct": None, "comm_pct": (100 * (1 - compute / low), 100 * (1 - compute / high)), "runs": runs}

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
    fixed = max(run_of[k]["step_seconds"] - repeats * busy[k] for k in orders)
    # Gradient reduction over the replicas, clipping's all-reduce: hidden at best, exposed at worst.
    rest = max(wire(r, lambda e: e["kind"] not in P2P) for r in runs)
    base = repeats * free + fixed
    low, high = repeats * delayed + fixed, repeats * blocked + fixed + rest
    return {"low": low, "high": high, "bubble_pct": 100 * (1 - sum(busy.values()) / len(busy) / free),
            "comm_pct": (100 * (1 - base / low), 100 * (1 - base / high)), "runs": runs}


def main():
    parser = argparse.ArgumentParser(description="The sweep's table, from its results folder.")
    parser.add_argument("out", nargs="?", help="the sweep's results folder")
    parser.add_argument("--roles", nargs="+", metavar="ARG", help="MODEL STRATEGY:N ...: print 'STRATEGY N RANK' for each rank a simulation runs")
    parser.add_argument("--intra-gbps", type=float, help="bus bandwidth per GPU inside a node (default: from LINK_GBPS)")
    parser.add_argument("--inter-gbps", type=float, help="bus bandwidth per GPU across nodes (default: from LINK_GBPS)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node holds, for predicted rows (default: 8)")
    args = parser.parse_args()
    if args.roles:
        n_layers = common.PRESETS[args.roles[0]].n_layers
        for item in args.roles[1:]:
            strategy, n = item.split(":")
            for rank in roles(strategy, int(n), n_layers):
                print(strategy, n, rank)
        return
    out_dir = args.out
    records, failures, simulated, sim_failures = load(out_dir)
    sample = (records + simulated or [{}])[0]
    intra, inter, source = link_bandwidth(sample.get("gpu_name"), args.intra_gbps, args.inter_gbps)
    rows = table_rows(records, failures, simulated, sim_failures, (intra, inter, args.gpus_per_node))
    print()
    print(tabulate(rows, headers=HEADERS, disable_numparse=True))
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True) + "\n")
    if sample:
        r = sample
        print(f"\n{r['model']} ({r['params'] / 1e6:,.1f}M parameters), {r['seq_len']} tokens per sample, torch {r['torch_version']}, "
              f"{r['gpu_name'] or 'CPU'}. Speedup: samples/s over the single-GPU baseline; efficiency: speedup / GPUs.")
    if simulated or sim_failures:
        print(f"Predicted rows: each rank's compute and memory measured on this one device (--simulate), its counted bytes "
              f"timed at {intra:g} GB/s inside a node and {inter:g} across ({args.gpus_per_node} GPUs a node; {source}); "
              "ranges run from communication hidden behind compute to fully exposed (README, 'Predicting').")
    print("The article (8x V100, 2.5B): DDP 3.73x on 4 and 6.31x on 8, model parallel 2.04x on 4, pipeline 2.63x on 4, "
          "hybrid 6.92x on 8; partly impossible (README, 'What the article claims'): contrast, do not fit.")
    print(f"Table: {out_dir}/table.md; results lines: {out_dir}/results.jsonl; logs: {out_dir}/logs/")
    if plot_speedup(records, failures, os.path.join(out_dir, "speedup.png")):
        print(f"Plot: {out_dir}/speedup.png")


if __name__ == "__main__":
    main()
