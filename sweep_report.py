"""The sweep's plan, its comparison table and its report, REPORT.md with five pictures
(matplotlib, where installed), from the lines its runs wrote: results.jsonl (one per
finished run), simulated.jsonl (one per simulated rank, run_all.sh --simulate) and
failures.jsonl (one per failed run, written by run_all.sh). Predicted rows turn each
simulated rank's measured compute and counted bytes into a step time on a modelled
wire. run_all.sh asks it for its plan (which runs, with which flags) and, where the
best settings of a strategy are not obvious, which of the settings it tried as
simulated ranks is fastest; at the end of a sweep it makes the table and the report.
Run again, it rebuilds them from the folder.

    python3 sweep_report.py OUT [--intra-gbps X] [--inter-gbps Y] [--gpus-per-node K] [--into DIR]
    python3 sweep_report.py --plan JSON                       # run_all.sh: the sweep's runs
    python3 sweep_report.py --best OUT SCRIPT N BATCH         # run_all.sh: the fastest settings tried"""

import argparse
import json
import math
import os
import re
import shutil
import sys

from tabulate import tabulate

import common
import pipeline_train

# The article's order, then context parallelism; any other strategy after them, by name.
ORDER = ["ddp", "model_parallel", "pipeline", "hybrid", "fsdp", "tp", "cp"]
# Lines written by run_all.sh name the script; these scripts' records name their strategy otherwise.
STRATEGY_OF_SCRIPT = {"tensor_parallel": "tp", "context_parallel": "cp"}
PREDICTED = " (predicted)"


class InputError(Exception):
    """An input the report or the plan cannot be made from: said in one line, exit status 2."""


# ----------------------------------------------------------------------------
# The lines a sweep wrote, each checked before it is used: a damaged one is left out and named
# ----------------------------------------------------------------------------

# What a field must hold, by kind; a kind ending in "?" also takes null.
def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v):
    return isinstance(v, int) and not isinstance(v, bool)


_ACTION = re.compile(r"[FBIW]\d+:\d+")
KINDS = {
    "text": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "whole": (lambda v: _whole(v) and v >= 0, "a whole number of at least 0"),
    "count": (lambda v: _whole(v) and v >= 1, "a whole number of at least 1"),
    "number": (lambda v: _number(v) and v >= 0, "a finite number of at least 0"),
    "positive": (lambda v: _number(v) and v > 0, "a finite number above 0"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "losses": (lambda v: isinstance(v, list) and v != [] and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
               "a non-empty list of numbers"),
    "numbers": (lambda v: isinstance(v, list) and v != [] and all(_number(x) and x >= 0 for x in v), "a non-empty list of numbers of at least 0"),
    "parts": (lambda v: isinstance(v, dict) and all(_number(v.get(k)) and v[k] >= 0 for k in ("data", "to_optimizer", "optimizer")),
              "an object of data, to_optimizer and optimizer seconds"),
    "seconds": (lambda v: isinstance(v, dict) and v != {} and all(isinstance(k, str) and _number(x) and x >= 0 for k, x in v.items()),
                "an object of seconds by action"),
    "mesh": (lambda v: isinstance(v, dict) and v != {} and all(_whole(x) and x >= 1 for x in v.values()), "an object of mesh sizes"),
    "order": (lambda v: isinstance(v, dict) and v != {} and all(k.isdigit() and isinstance(a, list) and all(isinstance(x, str) and _ACTION.fullmatch(x) for x in a)
                                                                  for k, a in v.items()),
              "an object of each rank's actions, such as \"F0:1\""),
    "comm": (lambda v: isinstance(v, list) and all(
        isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("group"), list) and e["group"] != []
        and all(_whole(r) and r >= 0 for r in e["group"]) and _whole(e.get("group_size")) and e["group_size"] >= 1
        and _number(e.get("bytes")) and e["bytes"] >= 0 and _whole(e.get("calls")) and e["calls"] >= 1 for e in v),
             "a list of counted collectives (kind, group, group_size, bytes, calls)"),
}
# Each kind of line: {field: kind} for the fields it must have, and those read where present.
RUN_FIELDS = {"strategy": "text", "world_size": "count", "global_batch_size": "count", "samples_per_sec": "positive",
              "step_seconds": "positive", "mfu": "number?", "peak_mem_gib": "number", "mem_pct": "positive", "model": "text",
              "params": "count", "seq_len": "count", "losses": "losses", "start_step": "whole", "gpu_name": "text?",
              "torch_version": "text", "config": "object"}
RUN_OPTIONAL = {"comm_pct": "number?", "bubble_pct": "number?", "utilisation_pct": "number?", "step_parts_seconds": "parts?",
                "peak_mem_gib_per_rank": "numbers?", "comm_per_step": "comm?", "allreduce_busbw_gbps": "number?", "comm_seconds": "number?",
                "finished_at": "text?", "mesh": "mesh", "pipeline_order": "order", "action_seconds": "seconds", "simulated_rank": "whole?"}
# A simulated rank's line feeds a prediction: its rank, its counted bytes, and what its strategy's prediction reads.
SIMULATED_FIELDS = {**RUN_FIELDS, "simulated_rank": "whole", "comm_per_step": "comm"}
SIMULATED_BY_STRATEGY = {"pipeline": {"pipeline_order": "order", "action_seconds": "seconds"},
                         "hybrid": {"pipeline_order": "order", "action_seconds": "seconds", "mesh": "mesh"},
                         "model_parallel": {"action_seconds": "seconds"}, "tp": {"mesh": "mesh"}}
FAILURE_FIELDS = {"strategy": "text", "world_size": "count", "global_batch_size": "count", "error": "text"}
FAILURE_OPTIONAL = {"flags": "string?", "simulated": "flag", "simulated_rank": "whole?", "float8": "text?", "log": "text?"}
# The settings of a run's config the table and the predictions read.
CONFIG_OPTIONAL = {"grad_accum": "count", "float8": "text?", "profile": "text?", "schedule": "text", "micro_batches": "count",
                   "stages_per_rank": "count?", "pp": "count", "dp": "count", "sequence_parallel": "flag", "cp": "count?",
                   "activation_checkpointing": "flag", "compile": "flag"}
CONFIG_BY_STRATEGY = {"pipeline": {"schedule": "text", "micro_batches": "count"}, "hybrid": {"schedule": "text", "micro_batches": "count"}}


def field_problem(line, required, optional=None):
    """Why a line cannot be used (its first bad field), or None."""
    for fields, must in ((required, True), (optional or {}, False)):
        for name, kind in fields.items():
            if name not in line:
                if must:
                    return f"no {name!r}"
                continue
            test, what = KINDS[kind.rstrip("?")]
            value = line[name]
            if not (value is None and kind.endswith("?")) and not test(value):
                return f"{name!r} is {json.dumps(value)[:40]}, not {what}"
    return None


def line_problem(line, kind):
    """Why one parsed line of a results file (kind: results, simulated or failures) cannot be used, or None."""
    if not isinstance(line, dict):
        return "not a JSON object"
    if kind == "failures":
        return field_problem(line, FAILURE_FIELDS, FAILURE_OPTIONAL)
    required = SIMULATED_FIELDS if kind == "simulated" else RUN_FIELDS
    problem = field_problem(line, required, RUN_OPTIONAL)
    if problem is None:
        problem = field_problem(line["config"], CONFIG_BY_STRATEGY.get(line["strategy"], {}), CONFIG_OPTIONAL)
        problem = problem and f"config: {problem}"
    if problem is None and kind == "simulated":
        problem = field_problem(line, SIMULATED_BY_STRATEGY.get(line["strategy"], {}))
        if problem is None and line["model"] not in common.PRESETS:
            problem = f"model {line['model']!r} is not a preset of common.py"
        if problem is None and line["simulated_rank"] >= line["world_size"]:
            problem = f"simulated_rank {line['simulated_rank']} is not below world_size {line['world_size']}"
    return problem


def read_lines(path, kind):
    """(the usable lines of one file, a note per line left out, as "path:line: why"). A
    missing file holds no lines; one that cannot be read is an InputError."""
    if not os.path.lexists(path):
        return [], []
    if os.path.exists(path) and not os.path.isfile(path):  # a folder, a FIFO (whose read would wait forever), a device
        raise InputError(f"{path} is not a file of results lines")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise InputError(f"{path} cannot be read: {e.strerror or e}") from None
    lines, skipped = [], []
    for number, data in enumerate(raw.split(b"\n"), 1):
        if not data.strip():
            continue
        try:
            line = json.loads(data.decode("utf-8"))
            problem = line_problem(line, kind)
        except UnicodeDecodeError:
            problem = "not UTF-8 text"
        except (ValueError, RecursionError) as e:  # json's errors are ValueErrors; nesting past the stack, RecursionError
            problem = f"not JSON ({str(e)[:60]})"
        if problem is None:
            lines.append(line)
        else:
            skipped.append(f"{path}:{number}: {problem}; left out")
    return lines, skipped


def check_folder(out_dir):
    """The sweep's folder, readable, or an InputError naming what it is instead."""
    if not os.path.exists(out_dir):
        raise InputError(f"{out_dir}: no such folder (name a sweep's results folder, e.g. results/<date-time>-<random>)")
    if not os.path.isdir(out_dir):
        raise InputError(f"{out_dir} is not a folder: name a sweep's results folder")
    if not os.access(out_dir, os.R_OK | os.X_OK):
        raise InputError(f"{out_dir} cannot be read (permission denied)")


def load(out_dir):
    """(records, failures, simulated ranks, their failures, notes on the lines left out)
    of one sweep, failures under their records' strategy names."""
    check_folder(out_dir)
    records, skipped = read_lines(os.path.join(out_dir, "results.jsonl"), "results")
    simulated, more = read_lines(os.path.join(out_dir, "simulated.jsonl"), "simulated")
    failures, most = read_lines(os.path.join(out_dir, "failures.jsonl"), "failures")
    failures = [named({**f, "strategy": STRATEGY_OF_SCRIPT.get(f["strategy"], f["strategy"])}) for f in failures]
    return ([named(r) for r in records], [f for f in failures if not f.get("simulated")], [named(r) for r in simulated],
            [f for f in failures if f.get("simulated")], skipped + more + most)


def named(run):
    """A float8 run (run_all.sh --float8) is a row of its own, named after its strategy."""
    mode = run.get("config", run).get("float8")
    return {**run, "strategy": f"{run['strategy']} float8 {mode}"} if mode else run


def base_strategy(name):
    return name.split(" float8")[0]


def run_key(run):
    return run["strategy"], run["world_size"], run["global_batch_size"]


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


# ----------------------------------------------------------------------------
# Settings: the flags the sweep chooses for each strategy, and which of those tried wins
# ----------------------------------------------------------------------------


def render_flags(strategy, settings):
    """The flags a strategy's run was given of those the sweep chooses, in the order
    run_all.sh passes them; settings is a run's config, or the plan's choice in its keys.
    "" for none."""
    flags = []
    if strategy == "hybrid":
        flags += ["--pp", settings.get("pp", 2)]
    if strategy in ("pipeline", "hybrid"):
        flags += ["--schedule", settings["schedule"], "--micro-batches", settings["micro_batches"]]
        if (settings.get("stages_per_rank") or 1) > 1:
            flags += ["--stages-per-rank", settings["stages_per_rank"]]
    if strategy == "tp":
        flags += ["--dp", settings["dp"]] if settings.get("dp", 1) > 1 else []
        flags += ["--sequence-parallel"] if settings.get("sequence_parallel") else []
    if strategy == "cp" and settings.get("cp") is not None:
        flags += ["--cp", settings["cp"]]
    if settings.get("grad_accum", 1) > 1:
        flags += ["--grad-accum", settings["grad_accum"]]
    if settings.get("activation_checkpointing"):
        flags.append("--activation-checkpointing")
    return " ".join(map(str, flags))


def flags_of(run):
    """The chosen flags a results line ran with (its config), as run_all.sh announced them."""
    return render_flags(base_strategy(run["strategy"]), run["config"])


def shown(records, failures):
    """The measured runs the table shows, one per run: of the settings tried for it, the
    fastest that finished (a line that appears twice counts by its newest); a run none of
    whose settings finished shows its newest failure. A settings' failure line outweighs
    a results line of the same settings (a run that wrote its figures, then failed); one
    without flags (older sweeps) stands for every settings of its run."""
    failed = {(run_key(f), f.get("flags")): f for f in failures}
    finished = {}
    for r in records:
        key, flags = run_key(r), flags_of(r)
        if (key, flags) not in failed and (key, None) not in failed:
            finished.setdefault(key, {})[flags] = r
    fastest = [max(by_flags.values(), key=lambda r: r["samples_per_sec"]) for by_flags in finished.values()]
    unfinished = {key: f for (key, _), f in failed.items() if key not in finished}
    return fastest, list(unfinished.values())


def measured_tried(records, failures):
    """{run key: {flags: results line or failure line}} of every settings a measured run tried."""
    tried = {}
    for line in [*records, *failures]:
        flags = line.get("flags") if "error" in line else flags_of(line)
        tried.setdefault(run_key(line), {})[flags] = line
    return tried


def _failed_prediction(failure, flags):
    return {"error": failure["error"], "simulated_rank": failure.get("simulated_rank"), "flags": flags}


def candidate_predictions(simulated, sim_failures, bandwidth):
    """{run key: {flags: predicted row (see predict) or the failure that stopped it}}: one
    entry per settings tried as simulated ranks. Its ranks' newest lines predict it; one
    that lacks a rank its prediction needs, or whose lines contradict each other, is an
    error of its own."""
    groups, failed = {}, {}
    for run in simulated:
        groups.setdefault((run_key(run), flags_of(run)), {})[run["simulated_rank"]] = run
    for f in sim_failures:
        failed[(run_key(f), f.get("flags"))] = f
    out = {}
    for (key, flags), by_rank in groups.items():
        failure = failed.get((key, flags)) or failed.get((key, None))
        out.setdefault(key, {})[flags] = _failed_prediction(failure, flags) if failure else _predicted(list(by_rank.values()), bandwidth, flags)
    for (key, flags), failure in failed.items():
        if flags not in out.get(key, {}) and not (flags is None and key in out):
            out.setdefault(key, {})[flags] = _failed_prediction(failure, flags)
    return out


def _predicted(runs, bandwidth, flags):
    first = runs[0]
    needed = set(roles_of(first))
    missing = sorted(needed - {r["simulated_rank"] for r in runs})
    if missing:
        return {"error": f"rank {', '.join(map(str, missing))} not simulated (an interrupted sweep?)", "simulated_rank": missing[0], "flags": flags}
    try:
        p = predict([r for r in runs if r["simulated_rank"] in needed], bandwidth)
        if not 0 < p["low"] <= p["high"]:
            raise ValueError(f"a step of {p['low']:.3g} to {p['high']:.3g} s")
        return {**p, "flags": flags}
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        # Lines that pass their own checks can still contradict each other (a schedule
        # whose ranks wait on each other, times that do not add up): said, not fatal.
        return {"error": f"its lines cannot be replayed ({type(e).__name__}: {str(e)[:60]})", "simulated_rank": first["simulated_rank"], "flags": flags}


def predicted_rate(p):
    """A prediction's samples/s at its fast end (communication hidden where the strategy overlaps it)."""
    return p["runs"][0]["global_batch_size"] / p["low"]


def choose(by_flags):
    """Of one run's settings tried as simulated ranks, the prediction shown for it: the
    fastest (its fast end), else, where none could be predicted, the newest failure."""
    done = [p for p in by_flags.values() if "error" not in p]
    return max(done, key=predicted_rate) if done else list(by_flags.values())[-1]


def predictions(simulated, sim_failures, bandwidth):
    """{run key: the predicted row shown for it (see choose)}."""
    return {key: choose(by_flags) for key, by_flags in candidate_predictions(simulated, sim_failures, bandwidth).items()}


# ----------------------------------------------------------------------------
# The table and the verdict
# ----------------------------------------------------------------------------


def is_baseline_run(run):
    return run["strategy"] == "ddp" and run["world_size"] == 1


def baseline(records):
    """The single-GPU baseline: the (fastest) ddp record at world size 1, or None."""
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


def on_gpus(runs):
    """Whether these lines come from GPUs (else CPU processes): what the counts are called."""
    return any(r.get("gpu_name") for r in runs)


def headers(gpus=True):
    return ["strategy", "GPUs" if gpus else "processes", "global batch", "samples/s", "speedup", "efficiency", "MFU", "peak GiB (%)",
            "overhead %", "measured vs predicted", "flags"]


def bracket(low, high, fmt, unit=""):
    """One cell for a range; a single figure where both ends round alike."""
    a, b = fmt.format(low), fmt.format(high)
    return f"{a}{unit}" if a == b else f"{a}-{b}{unit}"


def predicted_memory(p):
    """(GiB, % of the device) of a prediction's fullest rank."""
    return max(r["peak_mem_gib"] for r in p["runs"]), max(r["mem_pct"] for r in p["runs"])


def predicted_cells(p, base):
    """A predicted row's cells, from GPUs on: slow end first."""
    run = p["runs"][0]
    batch, n = run["global_batch_size"], run["world_size"]
    rates = (batch / p["high"], batch / p["low"])
    mem_gib, mem_pct = predicted_memory(p)
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
              f"comm {share}" + ("" if p["bubble_pct"] is None else f", bubble {p['bubble_pct']:.1f}"), "-", p["flags"] or "-"]
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
    base_name = base_strategy(strategy)
    return ORDER.index(base_name) if base_name in ORDER else len(ORDER), strategy, world_size, batch, predicted


def does_not_fit(error):
    return "out of memory" in error.lower()


def failed_prediction_cell(p):
    if does_not_fit(p["error"]):
        return f"does not fit: rank {p['simulated_rank']} ran out of memory"
    return f"rank {p['simulated_rank']}: {p['error'][:50]}" if p["simulated_rank"] is not None else p["error"][:60]


def table_rows(records, failures, simulated=(), sim_failures=(), bandwidth=None):
    """The table's rows (lists of cells, as headers()), in the article's order, each
    predicted row after the measured one of the same run where there is one."""
    records, failures = shown(records, failures)
    base = baseline(records)
    by_key = candidate_predictions(simulated, sim_failures, bandwidth) if simulated or sim_failures else {}
    predicted = {key: choose(by_flags) for key, by_flags in by_key.items()}

    def name(run):
        return "single-GPU baseline" if is_baseline_run(run) else run["strategy"]

    rows = []
    for r in records:
        s = speedup(r, base)
        flags = flags_of(r)
        # Against the prediction of the settings it ran, where they were tried.
        p = by_key.get(run_key(r), {}).get(flags, predicted.get(run_key(r)))
        rows.append(((*run_key(r), 0), [name(r), r["world_size"], r["global_batch_size"], f"{r['samples_per_sec']:.2f}",
                                        "-" if s is None else f"{s:.2f}x",
                                        "-" if s is None else f"{100 * s / r['world_size']:.0f}%",
                                        "-" if r["mfu"] is None else f"{r['mfu']:.1f}%",
                                        f"{r['peak_mem_gib']:.2f} ({r['mem_pct']:.0f}%)", overhead(r),
                                        against_prediction(r, p), flags or "-"]))
    for f in failures:
        rows.append(((*run_key(f), 0), [name(f), f["world_size"], f["global_batch_size"], f"failed: {f['error'][:60]}", *["-"] * 6,
                                        f.get("flags") or "-"]))
    for key, p in predicted.items():
        if "error" in p:
            rows.append(((*key, 1), [key[0] + PREDICTED, key[1], key[2], failed_prediction_cell(p), *["-"] * 6, p["flags"] or "-"]))
        else:
            rows.append(((*key, 1), [key[0] + PREDICTED, *predicted_cells(p, base)]))

    return [[str(cell) for cell in row] for _, row in sorted(rows, key=lambda pair: order_key(pair[0][:3], pair[0][3]))]


def counted(n, gpus):
    unit = "GPU" if gpus else "process"
    return f"{n} {unit}" + ("" if n == 1 else ("s" if gpus else "es"))


def ranking(records, failures, simulated=(), sim_failures=(), bandwidth=None):
    """Which strategy wins at each GPU count and global batch: [{"count", "batch",
    "source" (measured, or predicted where nothing was measured at that count), "ranked":
    [(name, samples/s, peak GiB of the fullest rank, % of its device)] fastest first
    (predicted: the fast end), "does_not_fit": [(name, why)], "failed": [(name, why)]}]."""
    records, failures = shown(records, failures)
    predicted = predictions(simulated, sim_failures, bandwidth) if simulated or sim_failures else {}
    jobs = {}
    for r in records:
        jobs.setdefault((r["world_size"], r["global_batch_size"]), {}).setdefault("measured", []).append(
            ("ranked", r["strategy"], r["samples_per_sec"], r["peak_mem_gib"], r["mem_pct"]))
    for f in failures:
        verdict = "does_not_fit" if does_not_fit(f["error"]) else "failed"
        jobs.setdefault((f["world_size"], f["global_batch_size"]), {}).setdefault("measured", []).append((verdict, f["strategy"], f["error"]))
    for (strategy, n, batch), p in predicted.items():
        if "error" in p:
            entry = ("does_not_fit" if does_not_fit(p["error"]) else "failed", strategy, failed_prediction_cell(p))
        else:
            gib, pct = predicted_memory(p)
            entry = ("does_not_fit", strategy, f"needs {gib:.1f} GiB, {pct:.0f}% of the device") if pct > 100 else \
                ("ranked", strategy, predicted_rate(p), gib, pct)
        jobs.setdefault((n, batch), {}).setdefault("predicted", []).append(entry)
    out = []
    for (n, batch), sources in sorted(jobs.items()):
        source = "measured" if "measured" in sources else "predicted"
        entries = sources[source]
        out.append({"count": n, "batch": batch, "source": source,
                    "ranked": sorted((e[1:] for e in entries if e[0] == "ranked"), key=lambda e: e[1], reverse=True),
                    "does_not_fit": [e[1:] for e in entries if e[0] == "does_not_fit"],
                    "failed": [e[1:] for e in entries if e[0] == "failed"]})
    return out


def verdict_lines(records, failures, simulated=(), sim_failures=(), bandwidth=None):
    """The ranking, one line per GPU count: "8 GPUs, 2.5b, global batch 64 (predicted):
    fsdp 250.1 samples/s (7.1x, 41.2 GiB), ...; does not fit: ..."."""
    shown_records = shown(records, failures)[0]
    base, gpus = baseline(shown_records), on_gpus([*records, *simulated])
    model = next((r["model"] for r in [*records, *simulated]), None)
    lines = []
    for job in ranking(records, failures, simulated, sim_failures, bandwidth):
        ranked = [f"{name} {rate:.2f} samples/s (" + ("" if base is None else f"{rate / base['samples_per_sec']:.2f}x, ") + f"{gib:.2f} GiB)"
                  for name, rate, gib, _ in job["ranked"]]
        parts = [", ".join(ranked) or "nothing finished"]
        parts += [f"does not fit: {', '.join(f'{name} ({why[:60]})' for name, why in job['does_not_fit'])}"] if job["does_not_fit"] else []
        parts += [f"failed: {', '.join(f'{name} ({why[:60]})' for name, why in job['failed'])}"] if job["failed"] else []
        lines.append(f"{counted(job['count'], gpus)}, {model or '?'}, global batch {job['batch']} ({job['source']}): " + "; ".join(parts))
    return lines



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
                     [(k, True, failed_prediction_cell(p)) for k, p in predicted.items() if "error" in p],
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
            role_of = {rank: role for role, ranks in roles_of(first).items() for rank in ranks}
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
    return {"speedup": {**speedups, "article": ARTICLE, "missing": missing, "gpus": on_gpus([*records, *simulated])},
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
    compiled = sum(1 for x in runs if x["config"].get("compile"))
    how = "compiled" if compiled == len(runs) else "eager" if not compiled else f"compiled: {compiled} of {len(runs)} runs"
    return f"{where} ({counts}) | {r['model']}, {r['params'] / 1e6:,.1f}M params, {how} | global batch {batch} x {r['seq_len']} tokens | {date}"


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


def _legend(ax, **options):
    """A legend where something is labelled (matplotlib warns of an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**options)


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
    unit = "GPUs" if data["gpus"] else "processes"
    ax.plot(counts, counts, "k:", label=f"ideal (speedup = {unit})")
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
    for axis, ylabel in ((ax, "speedup over the 1-GPU baseline (x)"), (ax_eff, f"scaling efficiency = speedup / {unit} (%)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts, [str(n) for n in counts])
        axis.set_xlabel("GPUs" if data["gpus"] else "processes (CPU, gloo)")
        axis.set_ylabel(ylabel)
    _legend(ax, fontsize=7, loc="upper left")
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
    _legend(ax, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(plt, fig, "Where a step's time goes (mean over ranks and timed steps)", meta, data["missing"], path)


def draw_loss(plt, data, meta, path):
    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(11, 4.5))
    base = data["curves"].get(data["baseline"])
    if base is not None:
        ax.plot(base["steps"], base["losses"], color="k", lw=3, alpha=0.35, label=f"{data['baseline']} (baseline)")
    markers = list(MARKERS.values()) + ["X", "*", "h"]
    for i, (name, curve) in enumerate((n, c) for n, c in data["curves"].items() if n != data["baseline"]):
        style = dict(marker=markers[i % len(markers)], ls=LINES[i % len(LINES)], color="k", ms=4, mfc="white")
        ax.plot(curve["steps"], curve["losses"], label=name + ("" if curve["same_data"] else " (larger batch)"), **style)
        if curve["same_data"] and base is not None:
            by_step = dict(zip(base["steps"], base["losses"]))
            pairs = [(s, abs(loss - by_step[s])) for s, loss in zip(curve["steps"], curve["losses"]) if s in by_step]
            if pairs:
                ax_diff.plot(*zip(*[(s, max(d, 1e-9)) for s, d in pairs]), label=name, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats per token)")
    _legend(ax, fontsize=7)
    ax_diff.set_yscale("log")
    ax_diff.set_xlabel("optimizer step")
    ax_diff.set_ylabel("|loss - baseline's loss| (nats, 1e-9 = equal)")
    ax_diff.set_title("same global batch as the baseline: the same run, so any drift is a bug (float8 rows: its rounding)", fontsize=8)
    _legend(ax_diff, fontsize=7)
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
    _legend(ax, fontsize=7, loc="lower right")
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
    _legend(ax_bw, fontsize=7)
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


# ----------------------------------------------------------------------------
# The plan: which runs a sweep makes, each strategy with which settings
# ----------------------------------------------------------------------------

# A pipeline takes the fewest micro-batches that bring its schedule's ideal bubble down to
# this (or, where the batch allows none, one sample each): each micro-batch more shrinks
# the matmuls and adds a transfer for less and less bubble.
BUBBLE_TARGET_PCT = 10
# The pipeline schedules tried (stages per rank), first the one used where none is tried.
# The zero-bubble schedules split backward by hand, which compiled blocks refuse.
SCHEDULES_TRIED = [("interleaved-1f1b", 2), ("1f1b", 1)]
# A CPU process's matmul rate, optimistic (an AVX-512 core in fp32), so that the time a
# CPU run is said to take is a lower bound.
CPU_FLOPS = 50e9


def micro_batches(batch, pp, schedule, stages_per_rank):
    """Micro-batches for one pipeline of pp ranks on `batch` samples: the fewest that
    split it evenly, number at least pp (1F1B's rule) and bring the ideal bubble to
    BUBBLE_TARGET_PCT, else one sample each; None where there are fewer samples than ranks."""
    divisors = [d for d in range(1, math.isqrt(batch) + 1) if batch % d == 0]
    counts = sorted(m for m in {*divisors, *(batch // d for d in divisors)} if m >= pp)
    if not counts:
        return None
    return next((m for m in counts if pipeline_train.theoretical_bubble_pct(schedule, pp, m, stages_per_rank) <= BUBBLE_TARGET_PCT), counts[-1])


def settings_tried(script, n, batch, n_layers, n_heads, seq_len):
    """(the settings to try for one strategy at n GPUs on this global batch, first the one
    used where they are not tried; or None and why it cannot run). Settings are a run's
    config keys (render_flags)."""
    strategy = STRATEGY_OF_SCRIPT.get(script, script)
    if strategy in ("pipeline", "hybrid"):
        if strategy == "hybrid" and n % 2:
            return None, "needs an even number of ranks, 2 pipeline stages x data parallel"
        pp = n if strategy == "pipeline" else 2
        dp = n // pp
        if pp > n_layers:
            return None, f"more stages than the model's {n_layers} blocks"
        if batch % dp:
            return None, f"global batch {batch} does not split over {dp} replicas"
        tried = []
        for schedule, per_rank in SCHEDULES_TRIED:
            m = micro_batches(batch // dp, pp, schedule, per_rank)
            if m and (per_rank == 1 or 1 < pp and pp * per_rank <= n_layers):  # one rank has nothing to interleave
                tried.append({"pp": pp, "schedule": schedule, "micro_batches": m, "stages_per_rank": per_rank})
        if not tried:
            return None, f"{batch // dp} samples per pipeline cannot make a micro-batch for each of its {pp} stages"
        return tried, None
    if strategy == "model_parallel":
        return ([{}], None) if n <= n_layers else (None, f"more ranks than the model's {n_layers} blocks")
    if strategy == "tp":
        if n_heads % n:
            return None, f"{n_heads} heads do not split over {n} ranks"
        return ([{"sequence_parallel": True}] if n > 1 and seq_len % n == 0 else []) + [{}], None
    if strategy == "cp":
        return ([{}], None) if seq_len % (2 * n) == 0 else (None, f"{seq_len} tokens do not cut into 2 x {n} equal chunks")
    # DDP, FSDP, and scripts the sweep does not know: data parallel, no settings of their own.
    return ([{}], None) if batch % n == 0 else (None, f"global batch {batch} does not split over {n} ranks")


def plan(spec):
    """The sweep's runs in the order run_all.sh makes them: for each strategy, first each
    settings tried at each simulated count (its distinct ranks), then each measured count
    (and its float8 run). spec: model, strategies (scripts), gpus and simulate (counts),
    batch (the 1-GPU global batch), strong, device, steps, seq_len, float8. Every
    strategy at n GPUs trains the same global batch: batch x n, or batch with strong.
    Rows: {script, n, mode (simulated, measured, float8), batch, ranks, settings (flags,
    first the default), choose (whether the fastest settings simulated at n is used),
    note} or {script, n, mode, skip: why}."""
    cfg = common.PRESETS[spec["model"]]
    rows = []

    def row(script, n, mode, batch, tried, **fields):
        strategy = STRATEGY_OF_SCRIPT.get(script, script)
        seconds = spec["steps"] * common.flops_per_token(cfg, spec["seq_len"]) * batch * spec["seq_len"] / (n * CPU_FLOPS)
        note = f"at least {seconds / 60:.0f} min on CPU" if spec["device"] == "cpu" and seconds > 60 else ""
        rows.append({"script": script, "n": n, "mode": mode, "batch": batch, "settings": [render_flags(strategy, s) for s in tried],
                     "note": note, **fields})

    for script in spec["strategies"]:
        strategy = STRATEGY_OF_SCRIPT.get(script, script)
        for mode, counts in (("simulated", spec["simulate"]), ("measured", spec["gpus"])):
            for n in counts:
                batch = spec["batch"] * (1 if spec["strong"] else n)
                tried, why = settings_tried(script, n, batch, cfg.n_layers, cfg.n_heads, spec["seq_len"])
                if why:
                    rows.append({"script": script, "n": n, "mode": mode, "skip": why})
                elif mode == "simulated":
                    for s in tried:
                        ranks = roles(strategy, n, cfg.n_layers, s.get("schedule", "1f1b"), s.get("stages_per_rank", 1), s.get("pp", 2))
                        row(script, n, mode, batch, [s], ranks=sorted(ranks), choose=False)
                else:
                    choose = len(tried) > 1 and n in spec["simulate"]
                    row(script, n, mode, batch, tried, ranks=[], choose=choose)
                    if spec["float8"]:
                        row(script, n, "float8", batch, tried, ranks=[], choose=choose)
    if all("skip" in r for r in rows):
        raise InputError("nothing to run: " + "; ".join(f"{r['script']} x{r['n']} {r['skip']}" for r in rows))
    return rows


def plan_line(row):
    """One row of the plan as run_all.sh reads it: tab-separated fields, "-" for none."""
    if "skip" in row:
        fields = ["skip", row["script"], row["n"], row["mode"], row["skip"]]
    else:
        fields = ["run", row["script"], row["n"], row["mode"], row["batch"], " ".join(map(str, row["ranks"])) or "-",
                  "|".join(s or "-" for s in row["settings"]), int(row["choose"]), row["note"] or "-"]
    return "\t".join(map(str, fields))


def parse_spec(text):
    """run_all.sh's --plan argument, checked."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise InputError(f"--plan: not JSON ({e})") from None
    kinds = {"model": str, "strategies": list, "gpus": list, "simulate": list, "batch": int, "strong": bool, "device": str, "steps": int,
             "seq_len": int, "float8": (str, type(None))}
    for name, kind in kinds.items():
        if not isinstance(spec, dict) or not isinstance(spec.get(name, ...), kind):
            raise InputError(f"--plan: {name!r} missing or not {kind}")
    if spec["model"] not in common.PRESETS:
        raise InputError(f"--plan: model {spec['model']!r} is not a preset of common.py")
    return spec


def write_report(into, records, failures, simulated, sim_failures, bandwidth, table, notes, link=True, skipped=()):
    """REPORT.md and, with matplotlib, the five pictures, in folder `into`; returns the pictures' paths."""
    data = figures(records, failures, simulated, sim_failures, bandwidth)
    meta = describe(shown(records, failures)[0], simulated)
    plt = _pyplot() if records or simulated else None
    pictures = {}
    if plt is not None:
        for key, draw in DRAW.items():
            draw(plt, data[key], meta, os.path.join(into, PICTURES[key]))
            pictures[key] = os.path.join(into, PICTURES[key])
    text = report_markdown(data, meta, table, notes, pictures, records, into, link)
    text += settings_markdown(records, failures, simulated, sim_failures, bandwidth)
    if skipped:
        text += "\n".join(["## Lines left out\n", "Damaged lines, named here and left out of every table and picture (the files keep them).\n",
                           *[f"- `{note}`" for note in skipped], ""]) + "\n"
    verdict = verdict_lines(records, failures, simulated, sim_failures, bandwidth)
    text += "\n".join(["## Which strategy wins\n", "At each count, every strategy on the same job, fastest first (a predicted row by the "
                       "fast end of its range), with the peak memory of its fullest rank.\n", *[f"- {line}" for line in verdict], ""])
    with open(os.path.join(into, "REPORT.md"), "w") as f:
        f.write(text)
    return pictures


def settings_markdown(records, failures, simulated, sim_failures, bandwidth):
    """REPORT.md's list of the settings tried for each run where there were several, the one shown first."""
    lines = []
    tried = candidate_predictions(simulated, sim_failures, bandwidth) if simulated or sim_failures else {}
    for key, by_flags in sorted(tried.items(), key=lambda kv: order_key(kv[0], True)):
        if len(by_flags) > 1:
            chosen = choose(by_flags)
            cells = [f"`{flags or 'no flags'}`: " + (p["error"][:70] if "error" in p else f"{predicted_rate(p):.2f} samples/s")
                     + (" (chosen)" if p is chosen else "") for flags, p in by_flags.items()]
            lines.append(f"- {name_of(key, True)}: " + "; ".join(cells))
    for key, by_flags in sorted(measured_tried(records, failures).items(), key=lambda kv: order_key(kv[0])):
        if len(by_flags) > 1:
            cells = [f"`{flags or 'no flags'}`: " + (f"failed: {line['error'][:70]}" if "error" in line else f"{line['samples_per_sec']:.2f} samples/s")
                     for flags, line in by_flags.items()]
            lines.append(f"- {name_of(key)}: " + "; ".join(cells))
    if not lines:
        return ""
    return "\n".join(["## Settings tried\n", "Where a strategy's best settings are not obvious, the sweep tries them as simulated ranks "
                      "and runs the fastest (predicted, fast end); a run out of memory is tried again with activation checkpointing.\n",
                      *lines, ""]) + "\n"


class _Parser(argparse.ArgumentParser):
    """A usage error in one line, as every other refusal."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def prepare_into(into, out_dir, given):
    """The folder the table and report go into, made where --into names a new one; an
    InputError if it cannot take them."""
    option = f"--into {into}" if given else out_dir
    if os.path.exists(into) and not os.path.isdir(into):
        raise InputError(f"{option} is not a folder")
    try:
        os.makedirs(into, exist_ok=True)
    except OSError as e:
        raise InputError(f"{option} cannot be made: {e.strerror or e}") from None
    if not os.access(into, os.W_OK | os.X_OK):
        raise InputError(f"{option} is not writable" + ("" if given else ": write the table and report elsewhere with --into DIR"))


def report(args):
    """The table on stdout, table.md and REPORT.md with its pictures; exit status 1 where lines were left out."""
    out_dir = args.out
    records, failures, simulated, sim_failures, skipped = load(out_dir)
    for note in skipped:
        print(f"sweep_report.py: {note}", file=sys.stderr)
    if not (records or failures or simulated or sim_failures):
        raise InputError(f"{out_dir} holds no usable results line, so there is nothing to report ("
                         + (f"{len(skipped)} damaged, named above)" if skipped else "results.jsonl, simulated.jsonl and failures.jsonl are missing or empty)"))
    into = args.into or out_dir
    prepare_into(into, out_dir, args.into is not None)
    sample = (records + simulated or [{}])[0]
    intra, inter, source = link_bandwidth(sample.get("gpu_name"), args.intra_gbps, args.inter_gbps)
    bandwidth = (intra, inter, args.gpus_per_node)
    rows = table_rows(records, failures, simulated, sim_failures, bandwidth)
    columns = headers(on_gpus([*records, *simulated]))
    verdict = verdict_lines(records, failures, simulated, sim_failures, bandwidth)
    print()
    print(tabulate(rows, headers=columns, disable_numparse=True))
    print(*["", "Which strategy wins:", *verdict], sep="\n")
    table = tabulate(rows, headers=columns, tablefmt="github", disable_numparse=True)
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
    try:
        # A report folder of its own (docs/): the lines it is built from go with it, so that
        # it rebuilds there; the sweep's folder may be read-only.
        if args.into and os.path.realpath(into) != os.path.realpath(out_dir):
            for name in ("results.jsonl", "simulated.jsonl", "failures.jsonl"):
                if os.path.exists(os.path.join(out_dir, name)):
                    shutil.copyfile(os.path.join(out_dir, name), os.path.join(into, name))
        with open(os.path.join(into, "table.md"), "w") as f:
            f.write("\n".join([table, "", "Which strategy wins:", "", *[f"- {line}" for line in verdict], ""]))
        pictures = write_report(into, records, failures, simulated, sim_failures, bandwidth, table, notes, link=not args.into, skipped=skipped)
    except OSError as e:
        hint = "" if args.into else "; write them elsewhere with --into DIR"
        raise InputError(f"cannot write into {into}: {e.strerror or e} ({e.filename or into}){hint}") from None
    print(f"Table: {into}/table.md; results lines: {out_dir}/results.jsonl; logs: {out_dir}/logs/")
    print(f"Report: {into}/REPORT.md" + (f" and {len(pictures)} pictures" if pictures else
                                          " (no pictures: pip install matplotlib, then python3 sweep_report.py " + out_dir + ")"))
    if skipped:
        print(f"sweep_report.py: {len(skipped)} damaged line{'s' if len(skipped) > 1 else ''} left out, named above "
              "(the table and report are of the rest)", file=sys.stderr)
        return 1
    return 0


def best(args):
    """run_all.sh --best OUT SCRIPT N BATCH: the flags of the fastest settings tried as
    simulated ranks for that run ("-" for none); exit status 1 where none was predicted."""
    out_dir, script, n, batch = args.best
    if not (n.isdigit() and batch.isdigit()):
        raise InputError(f"--best {' '.join(args.best)}: N and BATCH must be whole numbers")
    _, _, simulated, sim_failures, _ = load(out_dir)
    key = (STRATEGY_OF_SCRIPT.get(script, script), int(n), int(batch))
    bandwidth = (*link_bandwidth((simulated or [{}])[0].get("gpu_name"), args.intra_gbps, args.inter_gbps)[:2], args.gpus_per_node)
    by_flags = candidate_predictions([r for r in simulated if run_key(r) == key], [f for f in sim_failures if run_key(f) == key], bandwidth).get(key)
    chosen = by_flags and choose(by_flags)
    if not chosen or "error" in chosen:
        print(f"sweep_report.py: no settings of {script} x{n} (global batch {batch}) was predicted", file=sys.stderr)
        return 1
    print(chosen["flags"] or "-")
    return 0


def main(argv=None):
    parser = _Parser(prog="sweep_report.py", description="The sweep's table and report, from its results folder.")
    parser.add_argument("out", nargs="?", help="the sweep's results folder")
    parser.add_argument("--plan", metavar="JSON", help="run_all.sh's plan: print its runs, one tab-separated line each (see plan())")
    parser.add_argument("--best", nargs=4, metavar=("OUT", "SCRIPT", "N", "BATCH"),
                        help="print the flags of the fastest settings a sweep tried as simulated ranks for this run")
    parser.add_argument("--intra-gbps", type=common.positive_float, help="bus bandwidth per GPU inside a node (default: from LINK_GBPS)")
    parser.add_argument("--inter-gbps", type=common.positive_float, help="bus bandwidth per GPU across nodes (default: from LINK_GBPS)")
    parser.add_argument("--gpus-per-node", type=common.positive, default=8, help="GPUs a node holds, for predicted rows (default: 8)")
    parser.add_argument("--into", metavar="DIR", help="write REPORT.md and its pictures here (with copies of the lines they come from) "
                                                      "instead of into OUT, e.g. under docs/")
    try:
        args = parser.parse_args(argv)
        if args.plan is not None:
            if args.out or args.best or args.into:
                parser.error("--plan takes no folder")
            for row in plan(parse_spec(args.plan)):
                print(plan_line(row))
            return 0
        if args.best:
            if args.out or args.into:
                parser.error("--best names its folder itself: --best OUT SCRIPT N BATCH")
            return best(args)
        if not args.out:
            parser.error("name the sweep's results folder: python3 sweep_report.py OUT")
        return report(args)
    except InputError as e:
        print(f"sweep_report.py: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sweep_report.py: interrupted; run it again to rebuild the table and the report", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; Python's exit flush would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
