"""The lines a sweep wrote (results.jsonl, simulated.jsonl, failures.jsonl), each checked
before it is used: a damaged one is left out and named. Then what the table, the
predictions and the pictures all read of a run: its name, its key, its place in the
article's order, and the single-GPU baseline it is measured against."""

import json
import math
import os
import re

import common

# Lines written by run_all.sh name the script; these scripts' records name their strategy otherwise.
STRATEGY_OF_SCRIPT = {"tensor_parallel": "tp", "context_parallel": "cp"}


class InputError(Exception):
    """An input the report or the plan cannot be made from: said in one line, exit status 2."""


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


def named(run):
    """A float8 run (run_all.sh --float8) is a row of its own, named after its strategy."""
    mode = run.get("config", run).get("float8")
    return {**run, "strategy": f"{run['strategy']} float8 {mode}"} if mode else run


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


def base_strategy(name):
    return name.split(" float8")[0]


def run_key(run):
    return run["strategy"], run["world_size"], run["global_batch_size"]


# ----------------------------------------------------------------------------
# What the table and the pictures read of a run: its name, its order, its baseline
# ----------------------------------------------------------------------------

# The article's order, then context parallelism; any other strategy after them, by name.
ORDER = ["ddp", "model_parallel", "pipeline", "hybrid", "fsdp", "tp", "cp"]
PREDICTED = " (predicted)"


def order_key(key, predicted=False):
    """The article's order of strategies, float8 rows right after their strategy's, then
    GPUs and batch, a predicted row after the measured one of the same run."""
    strategy, world_size, batch = key
    base_name = base_strategy(strategy)
    return ORDER.index(base_name) if base_name in ORDER else len(ORDER), strategy, world_size, batch, predicted


def name_of(key, predicted=False):
    return f"{key[0]} x{key[1]}" + (PREDICTED if predicted else "")


def is_baseline_run(run):
    return run["strategy"] == "ddp" and run["world_size"] == 1


def baseline(records):
    """The single-GPU baseline: the (fastest) ddp record at world size 1, or None."""
    return next((r for r in reversed(records) if is_baseline_run(r)), None)


def speedup(record, base):
    """samples/s over the baseline's; None without a baseline."""
    return None if base is None else record["samples_per_sec"] / base["samples_per_sec"]


def on_gpus(runs):
    """Whether these lines come from GPUs (else CPU processes): what the counts are called."""
    return any(r.get("gpu_name") for r in runs)
