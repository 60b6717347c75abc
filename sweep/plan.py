"""The plan run_all.sh asks for (python3 sweep_report.py --plan JSON): which runs a sweep
makes, each strategy with which settings."""

import json
import math

import common
import pipeline_train
from sweep.lines import STRATEGY_OF_SCRIPT, InputError
from sweep.predict import roles
from sweep.settings import render_flags


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
