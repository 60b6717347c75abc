"""The sweep's comparison table and its report, REPORT.md with five pictures (matplotlib,
where installed), from the lines its runs wrote: results.jsonl (one per finished run),
simulated.jsonl (one per simulated rank, run_all.sh --simulate) and failures.jsonl (one
per failed run, written by run_all.sh). Predicted rows turn each simulated rank's
measured compute and counted bytes into a step time on a modelled wire. run_all.sh runs
it at the end of a sweep; run again, it rebuilds table and report from the folder.

    python3 sweep_report.py OUT [--intra-gbps X] [--inter-gbps Y] [--gpus-per-node K] [--into DIR]
    python3 sweep_report.py --roles MODEL STRATEGY:N ...   # the ranks a simulation runs"""

import argparse
import json
import os
import shutil

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


def order_key(key, predicted=False):
    """The article's order of strategies, float8 rows right after their strategy's, then
    GPUs and batch, a predicted row after the measured one of the same run."""
    strategy, world_size, batch = key
    base_name = strategy.split(" float8")[0]
    return ORDER.index(base_name) if base_name in ORDER else len(ORDER), strategy, world_size, batch, predicted


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

    return [[str(cell) for cell in row] for _, row in sorted(rows, key=lambda pair: order_key(pair[0][:3], pair[0][3]))]


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
    it; high: all of it exposed), with the communication's share of each end, for
    pipelines the bubble of the replayed schedule, and the low end's step split into
    the parts of step_split (None where a rank's line has no parts)."""
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


# ----------------------------------------------------------------------------
# The report: REPORT.md and its five pictures. figures() takes every number a picture
# shows from the results lines (the tests read them there); draw_* only draw them.
# ----------------------------------------------------------------------------

# The article's points (8x V100, 2.5B): (strategy, GPUs, speedup); contrasted, never fitted.
ARTICLE = [("ddp", 1, 1.0), ("ddp", 4, 3.73), ("ddp", 8, 6.31), ("model_parallel", 4, 2.04), ("pipeline", 4, 2.63), ("hybrid", 8, 6.92)]
PICTURES = {"speedup": "speedup.png", "split": "step_split.png", "loss": "loss.png", "memory": "memory.png", "comm": "communication.png"}
# Each part of a step: its label, a grey and a hatch, so that it reads in black and white.
PART_STYLE = {"data": ("data wait", "0.97", ".."), "compute": ("compute", "0.6", ""), "comm": ("exposed communication", "0.85", "//"),
              "bubble": ("bubble: waiting for other stages", "1.0", "xx"), "optimizer": ("optimizer step", "0.35", ""),
              "rest": ("rest: zero_grad, loss all-reduce, sync", "0.9", "--")}
MARKERS = {"ddp": "o", "model_parallel": "s", "pipeline": "^", "hybrid": "D", "fsdp": "v", "tp": "P"}
LINES = ["-", "--", "-.", ":"]


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


def name_of(key, predicted=False):
    return f"{key[0]} x{key[1]}" + (PREDICTED if predicted else "")


def capacity_gib(run):
    return 100 * run["peak_mem_gib"] / run["mem_pct"]


def sent_bytes(run):
    """Bytes per step the counted rank puts on the wire, by kind (a receive is its peer's send)."""
    by_kind = {}
    for e in run.get("comm_per_step") or []:
        if e["kind"] != "recv" and e["group_size"] > 1:
            by_kind[e["kind"]] = by_kind.get(e["kind"], 0.0) + wire_bytes(e)
    return by_kind


def figures(records, failures, simulated=(), sim_failures=(), bandwidth=None):
    """{picture: the numbers it shows}, from the sweep's lines. Runs come in the table's
    order, a predicted one after the measured one of the same run; a failed run is
    listed under "missing" with why, and never drawn as zero."""
    records, failures = shown(records, failures)
    base = baseline(records)
    predicted = predictions(simulated, sim_failures, bandwidth) if simulated or sim_failures else {}
    entries = sorted([(run_key(r), False, r) for r in records] + [(k, True, p) for k, p in predicted.items() if "error" not in p],
                     key=lambda e: order_key(e[0], e[1]))
    missing = sorted([(run_key(f), False, f"failed: {f['error'][:70]}") for f in failures] +
                     [(k, True, f"rank {p.get('simulated_rank')}: {p['error'][:60]}") for k, p in predicted.items() if "error" in p],
                     key=lambda m: order_key(m[0], m[1]))
    missing = [{"name": name_of(key, p), "why": why} for key, p, why in missing]

    speedups, split, memory, comm = {"measured": {}, "predicted": {}}, [], [], []
    for key, is_prediction, run in entries:
        name = name_of(key, is_prediction)
        if is_prediction:
            first = run["runs"][0]
            if base is not None:
                slow, fast = (key[2] / run[end] / base["samples_per_sec"] for end in ("high", "low"))
                speedups["predicted"].setdefault(key[0], []).append((key[1], slow, fast))
            split.append({"name": name, "step": run["low"], "range": (run["low"], run["high"]), "parts": run["split"]})
            by_rank = {r["simulated_rank"]: r for r in run["runs"]}
            role_of = {rank: role for role, ranks in roles(key[0], key[1], common.PRESETS[first["model"]].n_layers).items() for rank in ranks}
            memory.append({"name": name, "per_rank": [by_rank[role_of[rank]]["peak_mem_gib"] for rank in range(key[1])], "capacity": capacity_gib(first)})
            comm.append({"name": name, "bytes": sent_bytes(by_rank[0]), "busbw_gbps": None})
        else:
            if base is not None:
                s = speedup(run, base)
                speedups["measured"].setdefault(key[0], []).append((key[1], s))
            split.append({"name": name, "step": run["step_seconds"], "range": None, "parts": step_split(run)})
            memory.append({"name": name, "per_rank": run.get("peak_mem_gib_per_rank") or [run["peak_mem_gib"]], "capacity": capacity_gib(run)})
            if key[1] > 1:
                comm.append({"name": name, "bytes": sent_bytes(run), "busbw_gbps": run.get("allreduce_busbw_gbps")})
    curves = {name_of(run_key(r)): {"steps": list(range(r["start_step"] + 1, r["start_step"] + len(r["losses"]) + 1)), "losses": r["losses"],
                                    "same_data": base is not None and run_key(r)[2] == base["global_batch_size"]}
              for key, is_prediction, r in entries if not is_prediction}
    return {"speedup": {**speedups, "article": ARTICLE, "missing": missing},
            "split": {"bars": split, "missing": missing},
            "loss": {"baseline": None if base is None else name_of(run_key(base)), "curves": curves,
                     "missing": [m for m in missing if PREDICTED not in m["name"]]},
            "memory": {"bars": memory, "missing": missing},
            "comm": {"bars": comm, "link_gbps": None if bandwidth is None else bandwidth[0], "missing": missing}}


def describe(records, simulated):
    """What every picture names: hardware, model, batch and date, in one line."""
    runs = records + simulated
    if not runs:
        return "no run finished"
    r = runs[0]
    measured = sorted({x["world_size"] for x in records})
    predicted = sorted({x["world_size"] for x in simulated})
    where = r["gpu_name"] or "CPU (gloo processes)"
    counts = (f"{','.join(map(str, measured))} measured" if measured else "") + \
        (f"{'; ' if measured else ''}{','.join(map(str, predicted))} predicted from one" if predicted else "")
    batches = sorted({x["global_batch_size"] for x in runs})
    batch = str(batches[0]) if len(batches) == 1 else f"{batches[0]}-{batches[-1]}"
    date = max((x.get("finished_at") or "" for x in runs), default="") or "date not recorded"
    return f"{where} ({counts}) | {r['model']}, {r['params'] / 1e6:,.1f}M params | global batch {batch} x {r['seq_len']} tokens | {date}"


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display), or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "hatch.linewidth": 0.6, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _missing_note(fig, missing):
    if missing:
        fig.text(0.01, -0.01, "missing (not drawn): " + "; ".join(f"{m['name']} {m['why']}" for m in missing)[:300],
                 fontsize=7, va="top", wrap=True)


def _save(plt, fig, title, meta, missing, path):
    fig.tight_layout(rect=(0, 0, 1, 0.92))  # room for the two title lines above the axes' own titles
    fig.suptitle(f"{title}\n{meta}", fontsize=10)
    _missing_note(fig, missing)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def draw_speedup(plt, data, meta, path):
    fig, (ax, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.5))
    counts = sorted({n for pts in [*data["measured"].values(), *data["predicted"].values()] for n, *_ in pts} | {n for _, n, _ in data["article"]})
    ax.plot(counts, counts, "k:", label="ideal (speedup = GPUs)")
    ax_eff.axhline(100, color="k", ls=":", label="ideal")
    strategies = sorted(set(data["measured"]) | set(data["predicted"]), key=lambda s: order_key((s, 0, 0)))
    for i, strategy in enumerate(strategies):
        marker, line = MARKERS.get(strategy, "X"), LINES[i % len(LINES)]
        points = sorted(data["measured"].get(strategy, []))
        if points:
            ns, gains = zip(*points)
            ax.plot(ns, gains, marker=marker, ls=line, color="k", label=f"{strategy} measured")
            ax_eff.plot(ns, [100 * g / n for n, g in points], marker=marker, ls=line, color="k", label=f"{strategy} measured")
        ranges = sorted(data["predicted"].get(strategy, []))
        for j, (n, slow, fast) in enumerate(ranges):
            offset = n * (1 + 0.03 * (i - len(strategies) / 2))  # strategies side by side at one count
            for axis, scale in ((ax, 1), (ax_eff, 100 / n)):
                axis.errorbar([offset], [(slow + fast) / 2 * scale], yerr=[[(fast - slow) / 2 * scale]], fmt=marker, mfc="white", mec="0.3",
                              ecolor="0.3", capsize=4, label=f"{strategy} predicted (range)" if j == 0 else None)
    for j, (strategy, n, gain) in enumerate(data["article"]):
        for axis, value in ((ax, gain), (ax_eff, 100 * gain / n)):
            axis.plot([n], [value], marker="*", ms=11, mfc="white", mec="k", ls="none", label="the article (8x V100), its claims" if j == 0 else None)
            axis.annotate(f"article {strategy}", (n, value), textcoords="offset points", xytext=(5, -3), fontsize=7)
    for axis, ylabel in ((ax, "speedup over the 1-GPU baseline (x)"), (ax_eff, "scaling efficiency = speedup / GPUs (%)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts, [str(n) for n in counts])
        axis.set_xlabel("GPUs (processes on CPU)")
        axis.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="upper left")
    _save(plt, fig, "Speedup and scaling efficiency", meta, data["missing"], path)


def draw_split(plt, data, meta, path):
    bars = data["bars"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * max(1, len(bars))))
    y = list(range(len(bars)))[::-1]
    drawn = set()
    for row, bar in zip(y, bars):
        if bar["parts"] is None:
            ax.text(0, row, "  no step split in this run's results line", va="center", fontsize=8)
            continue
        left = 0.0
        for part, (text, grey, hatch) in PART_STYLE.items():
            seconds = bar["parts"].get(part)
            if not seconds:
                continue
            ax.barh(row, 1000 * seconds, left=1000 * left, color=grey, hatch=hatch, edgecolor="k", lw=0.5,
                    label=text if part not in drawn else None)
            drawn.add(part)
            left += seconds
        if bar["range"] is not None:  # the prediction's bracket: communication hidden ... all exposed
            low, high = bar["range"]
            ax.errorbar([1000 * (low + high) / 2], [row], xerr=[[1000 * (high - low) / 2]], fmt="none", ecolor="k", capsize=5, lw=1.2,
                        label="predicted range: comm hidden ... all exposed" if "range" not in drawn else None)
            drawn.add("range")
        notes = [] if bar["parts"].get("comm") is not None else ["comm not measured apart: inside compute"]
        ax.text(1000 * max(left, (bar["range"] or (0, 0))[1]), row, "  " + "; ".join([f"{1000 * bar['step']:.1f} ms", *notes]), va="center", fontsize=7)
    ax.set_yticks(y, [b["name"] for b in bars])
    ax.set_xlabel("time per optimizer step (ms)")
    ax.margins(x=0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(plt, fig, "Where a step's time goes (mean over ranks and timed steps)", meta, data["missing"], path)


def draw_loss(plt, data, meta, path):
    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(11, 4.5))
    base = data["curves"].get(data["baseline"])
    if base is not None:
        ax.plot(base["steps"], base["losses"], color="k", lw=3, alpha=0.35, label=f"{data['baseline']} (baseline)")
    markers = list(MARKERS.values()) + ["X", "*", "h"]
    diffs = False
    for i, (name, curve) in enumerate((n, c) for n, c in data["curves"].items() if n != data["baseline"]):
        style = dict(marker=markers[i % len(markers)], ls=LINES[i % len(LINES)], color="k", ms=4, mfc="white")
        ax.plot(curve["steps"], curve["losses"], label=name + ("" if curve["same_data"] else " (larger batch)"), **style)
        if curve["same_data"] and base is not None:
            by_step = dict(zip(base["steps"], base["losses"]))
            pairs = [(s, abs(loss - by_step[s])) for s, loss in zip(curve["steps"], curve["losses"]) if s in by_step]
            if pairs:
                ax_diff.plot(*zip(*[(s, max(d, 1e-9)) for s, d in pairs]), label=name, **style)
                diffs = True
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats per token)")
    ax.legend(fontsize=7)
    ax_diff.set_yscale("log")
    ax_diff.set_xlabel("optimizer step")
    ax_diff.set_ylabel("|loss - baseline's loss| (nats, 1e-9 = equal)")
    ax_diff.set_title("same global batch as the baseline: the same run, so any drift is a bug (float8 rows: its rounding)", fontsize=8)
    if diffs:
        ax_diff.legend(fontsize=7)
    _save(plt, fig, "Loss of every run over the baseline's", meta, data["missing"], path)


def draw_memory(plt, data, meta, path):
    """One row per run, however many ranks: a bar to its fullest rank (the one that decides
    whether the run fits), a tick for every rank, the device's capacity as a dashed line."""
    bars = data["bars"]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.6))
    for y, bar in enumerate(bars):
        peak = max(bar["per_rank"])
        ax.barh(y, peak, height=0.6, color="0.85" if PREDICTED in bar["name"] else "0.55", hatch="//" if PREDICTED in bar["name"] else "",
                edgecolor="k", lw=0.5)
        ax.plot(bar["per_rank"], [y] * len(bar["per_rank"]), "k|", ms=9, label="each rank" if y == 0 else None)
        ax.vlines(bar["capacity"], y - 0.4, y + 0.4, colors="k", linestyles="--", lw=1.2, label="device capacity" if y == 0 else None)
        ax.text(peak, y, f" {peak:.1f} ({100 * peak / bar['capacity']:.0f}%)", va="center", fontsize=7)
    ax.set_yticks(range(len(bars)), [b["name"] for b in bars], fontsize=8)
    ax.invert_yaxis()
    if bars and max(max(b["per_rank"]) for b in bars) < 0.1 * max(b["capacity"] for b in bars):
        ax.set_xscale("log")  # else the peaks are invisible beside the capacity
    ax.set_xlabel("peak memory of the fullest rank (GiB" + (", log scale" if ax.get_xscale() == "log" else "") +
                  "; CPU: resident set); light hatched bars: predicted, each rank simulated alone")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    _save(plt, fig, "Peak memory per rank against the device's capacity", meta, data["missing"], path)


def draw_comm(plt, data, meta, path):
    bars = data["bars"]
    fig, (ax, ax_bw) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    kinds = sorted({k for b in bars for k in b["bytes"]})
    hatches = ["", "//", "..", "xx", "\\\\", "--", "oo"]
    greys = ["0.5", "0.75", "0.95", "0.65", "0.85", "0.4", "1.0"]
    for i, bar in enumerate(bars):
        bottom = 0.0
        for j, kind in enumerate(kinds):
            gb = bar["bytes"].get(kind, 0.0) / 1e9
            if gb:
                ax.bar(i, gb, bottom=bottom, color=greys[j % len(greys)], hatch=hatches[j % len(hatches)], edgecolor="k", lw=0.5)
                bottom += gb
        ax.text(i, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=6, rotation=90)
    if kinds:
        ax.legend([plt.Rectangle((0, 0), 1, 1, facecolor=greys[j % len(greys)], hatch=hatches[j % len(hatches)], edgecolor="k")
                   for j in range(len(kinds))], kinds, fontsize=7, title="collective", title_fontsize=7)
    ax.set_xticks(range(len(bars)), [b["name"] for b in bars], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("GB each rank sends per step (ring algorithms)")
    if not bars:
        ax.text(0.5, 0.5, "no run above one GPU", ha="center", transform=ax.transAxes)
    measured = [(b["name"], b["busbw_gbps"]) for b in bars if b["busbw_gbps"] is not None]
    if measured:
        ax_bw.bar(range(len(measured)), [v for _, v in measured], color="0.6", hatch="//", edgecolor="k", label="measured all-reduce bus bandwidth")
        ax_bw.set_xticks(range(len(measured)), [n for n, _ in measured], rotation=45, ha="right", fontsize=7)
    else:
        ax_bw.text(0.5, 0.75, "not measured here:\nddp_train.py measures it at 2+ GPUs", ha="center", va="center", transform=ax_bw.transAxes)
        ax_bw.set_xticks([])
    if data["link_gbps"] is not None:
        ax_bw.axhline(data["link_gbps"], color="k", ls="--", label=f"modelled for predictions: {data['link_gbps']:g} GB/s")
    shown_gbps = [v for _, v in measured] + ([data["link_gbps"]] if data["link_gbps"] is not None else [])
    if shown_gbps and max(shown_gbps) > 100 * min(shown_gbps):
        ax_bw.set_yscale("log")  # CPU processes reach a fraction of a GB/s, a GPU link hundreds
    ax_bw.set_ylabel("bus bandwidth (GB/s" + (", log scale" if ax_bw.get_yscale() == "log" else "") + ")")
    ax_bw.legend(fontsize=7)
    _save(plt, fig, "Bytes on the wire per step, and the bandwidth achieved", meta, data["missing"], path)


DRAW = {"speedup": draw_speedup, "split": draw_split, "loss": draw_loss, "memory": draw_memory, "comm": draw_comm}


def _ms(seconds, part=None):
    if seconds is None:  # see step_split
        return {"comm": "in compute", "bubble": "none"}.get(part, "-")
    return f"{1000 * seconds:.2f}"


def _where(path, into, link):
    """A file a run wrote, as a link relative to the report where it is there to follow, else as its path."""
    if path and link and os.path.exists(path):
        return f"[{os.path.basename(path)}]({os.path.relpath(path, into)})"
    return f"`{path}`" if path else "-"


def report_markdown(data, meta, table, notes, pictures, records, into, link):
    """REPORT.md's text: the table, each picture with how to read it and the numbers it shows."""
    out = [f"# Sweep report\n\n{meta}\n"]
    if not pictures:
        out.append("> The pictures need matplotlib: `pip install matplotlib`, then `python3 sweep_report.py RESULTS_FOLDER` "
                   "rebuilds this report with them.\n")
    out += ["## The table\n", table, "", *[f"{line}  " for line in notes], ""]

    def picture(key, title, how):
        out.extend([f"## {title}\n", how + "\n"])
        if key in pictures:
            out.append(f"![{title}]({PICTURES[key]})\n")

    picture("speedup", "1. Speedup and scaling efficiency",
            "Samples/s over the single-GPU baseline against GPUs, and that speedup divided by the GPUs. The dotted line is "
            "perfect scaling; filled markers are measured, hollow ones with a bracket predicted (slow end: all communication "
            "exposed; fast end: hidden where the strategy overlaps it); stars are the article's claims on 8x V100, partly "
            "impossible (README, 'What the article claims'): contrast, do not fit.")
    picture("split", "2. Where a step's time goes",
            "Each run's mean timed step, split into the waits for data, compute (forward, backward, clipping), exposed "
            "communication, the pipeline bubble (waiting for other stages and their transfers), the optimizer step and the rest, "
            "averaged over ranks; the parts add up to the measured step. A predicted bar is the prediction's fast end, with its "
            "range bracketed. Where a strategy does not measure its communication apart (FSDP, tensor parallel, pipelines' "
            "transfers), it sits inside compute or the bubble, and says so.")
    out.append("| run | step ms | " + " | ".join(PART_STYLE[p][0] + " ms" for p in SPLIT_PARTS) + " |")
    out.append("|" + " --- |" * (len(SPLIT_PARTS) + 2))
    for bar in data["split"]["bars"]:
        parts = bar["parts"] or {}
        step = _ms(bar["step"]) if bar["range"] is None else f"{_ms(bar['range'][0])}-{_ms(bar['range'][1])}"
        out.append(f"| {bar['name']} | {step} | " + " | ".join(_ms(parts.get(p), p) if parts else "no split" for p in SPLIT_PARTS) + " |")
    out.append("")
    picture("loss", "3. Loss curves",
            "Every run's loss at every step over the baseline's (thick grey). Runs of the same global batch train the same run "
            "and should lie on it; the right panel shows how far each is from it, where 1e-9 means equal.")
    base = data["loss"]["curves"].get(data["loss"]["baseline"])
    out += ["| run | steps | last loss | largest difference from the baseline |", "| --- | --- | --- | --- |"]
    for name, c in data["loss"]["curves"].items():
        diff = "-"
        if base is not None and c["same_data"] and name != data["loss"]["baseline"]:
            by_step = dict(zip(base["steps"], base["losses"]))
            diff = f"{max((abs(l - by_step[s]) for s, l in zip(c['steps'], c['losses']) if s in by_step), default=0.0):.2e}"
        out.append(f"| {name} | {c['steps'][0]}-{c['steps'][-1]} | {c['losses'][-1]:.4f} | {diff} |")
    out.append("")
    picture("memory", "4. Peak memory per rank",
            "Each rank's peak (the CUDA caching allocator's reserve; on CPU the resident set, mostly torch itself) against the "
            "device's capacity (dashed). Predicted ranks were each run alone on this device.")
    out += ["| run | peak GiB per rank | capacity GiB |", "| --- | --- | --- |"]
    out += [f"| {b['name']} | {', '.join(f'{g:.2f}' for g in b['per_rank'])} | {b['capacity']:.1f} |" for b in data["memory"]["bars"]]
    out.append("")
    picture("comm", "5. Communication",
            "Bytes each rank puts on the wire per step, counted at the process group (common.CommCounter) and turned into ring "
            "traffic, by collective; beside them the all-reduce bus bandwidth ddp_train.py measures at 2+ GPUs, against the "
            "figure the predictions assume.")
    out += ["| run | GB per step | by collective | measured bus bandwidth GB/s |", "| --- | --- | --- | --- |"]
    for b in data["comm"]["bars"]:
        kinds = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in sorted(b["bytes"].items())) or "-"
        bw = "-" if b["busbw_gbps"] is None else f"{b['busbw_gbps']:.1f}"
        out.append(f"| {b['name']} | {sum(b['bytes'].values()) / 1e9:.3g} | {kinds} | {bw} |")
    out.append("")
    profiled = [(name_of(run_key(r)), r["config"]["profile"]) for r in records if r.get("config", {}).get("profile")]
    if profiled:
        out += ["## Profiles\n", "One Chrome trace per rank (open it in https://ui.perfetto.dev or chrome://tracing) and the op "
                "table, heaviest first by device time (self CPU time on a CPU).\n", "| run | traces | op tables |", "| --- | --- | --- |"]
        for name, folder in profiled:
            # A sweep folder copied off the machine that ran it still has its profiles in profiles/.
            if not os.path.isdir(folder):
                folder = os.path.join(into, "profiles", os.path.basename(os.path.normpath(folder)))
            files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
            traces = [_where(os.path.join(folder, f), into, link) for f in files if f.startswith("trace_rank")]
            tables = [_where(os.path.join(folder, f), into, link) for f in files if f.startswith("ops_rank")]
            out.append(f"| {name} | {', '.join(traces) or 'not here'} | {', '.join(tables) or '-'} |")
        out.append("")
    if data["split"]["missing"]:
        out += ["## Missing runs\n", "Shown in no picture and as failed in the table; never as zero.\n", "| run | why |", "| --- | --- |"]
        out += [f"| {m['name']} | {m['why']} |" for m in data["split"]["missing"]]
        out.append("")
    return "\n".join(out)


def write_report(into, records, failures, simulated, sim_failures, bandwidth, table, notes, link=True):
    """REPORT.md and, with matplotlib, the five pictures, in folder `into`; returns the pictures' paths."""
    data = figures(records, failures, simulated, sim_failures, bandwidth)
    meta = describe(shown(records, failures)[0], simulated)
    plt = _pyplot() if records or simulated else None
    pictures = {}
    if plt is not None:
        for key, draw in DRAW.items():
            draw(plt, data[key], meta, os.path.join(into, PICTURES[key]))
            pictures[key] = os.path.join(into, PICTURES[key])
    with open(os.path.join(into, "REPORT.md"), "w") as f:
        f.write(report_markdown(data, meta, table, notes, pictures, records, into, link))
    return pictures


def main():
    parser = argparse.ArgumentParser(description="The sweep's table, from its results folder.")
    parser.add_argument("out", nargs="?", help="the sweep's results folder")
    parser.add_argument("--roles", nargs="+", metavar="ARG", help="MODEL STRATEGY:N ...: print 'STRATEGY N RANK' for each rank a simulation runs")
    parser.add_argument("--intra-gbps", type=float, help="bus bandwidth per GPU inside a node (default: from LINK_GBPS)")
    parser.add_argument("--inter-gbps", type=float, help="bus bandwidth per GPU across nodes (default: from LINK_GBPS)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node holds, for predicted rows (default: 8)")
    parser.add_argument("--into", metavar="DIR", help="write REPORT.md and its pictures here (with copies of the lines they come from) "
                                                      "instead of into OUT, e.g. under docs/")
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
    bandwidth = (intra, inter, args.gpus_per_node)
    rows = table_rows(records, failures, simulated, sim_failures, bandwidth)
    print()
    print(tabulate(rows, headers=HEADERS, disable_numparse=True))
    table = tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True)
    notes = []
    if sample:
        r = sample
        notes.append(f"{r['model']} ({r['params'] / 1e6:,.1f}M parameters), {r['seq_len']} tokens per sample, torch {r['torch_version']}, "
                     f"{r['gpu_name'] or 'CPU'}. Speedup: samples/s over the single-GPU baseline; efficiency: speedup / GPUs.")
    if simulated or sim_failures:
        notes.append(f"Predicted rows: each rank's compute and memory measured on this one device (--simulate), its counted bytes "
                     f"timed at {intra:g} GB/s inside a node and {inter:g} across ({args.gpus_per_node} GPUs a node; {source}); "
                     "ranges run from communication hidden behind compute to fully exposed (README, 'Predicting').")
    notes.append("The article (8x V100, 2.5B): DDP 3.73x on 4 and 6.31x on 8, model parallel 2.04x on 4, pipeline 2.63x on 4, "
                 "hybrid 6.92x on 8; partly impossible (README, 'What the article claims'): contrast, do not fit.")
    print(*[f"\n{notes[0]}", *notes[1:]] if sample else notes, sep="\n")
    into = args.into or out_dir
    # A report folder of its own (docs/): the lines it is built from go with it, so that
    # it rebuilds there; the sweep's folder may be read-only.
    if args.into and os.path.realpath(into) != os.path.realpath(out_dir):
        os.makedirs(into, exist_ok=True)
        for name in ("results.jsonl", "simulated.jsonl", "failures.jsonl"):
            if os.path.exists(os.path.join(out_dir, name)):
                shutil.copyfile(os.path.join(out_dir, name), os.path.join(into, name))
    with open(os.path.join(into, "table.md"), "w") as f:
        f.write(table + "\n")
    pictures = write_report(into, records, failures, simulated, sim_failures, bandwidth, table, notes, link=not args.into)
    print(f"Table: {into}/table.md; results lines: {out_dir}/results.jsonl; logs: {out_dir}/logs/")
    print(f"Report: {into}/REPORT.md" + (f" and {len(pictures)} pictures" if pictures else
                                          " (no pictures: pip install matplotlib, then python3 sweep_report.py " + out_dir + ")"))


if __name__ == "__main__":
    main()
