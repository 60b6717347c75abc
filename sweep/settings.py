"""Settings: the flags the sweep chooses for each strategy, and which of those tried wins,
measured (the fastest that finished) or predicted (the fastest prediction's fast end)."""

from sweep.lines import base_strategy, run_key
from sweep.predict import predict, roles_of


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


def does_not_fit(error):
    return "out of memory" in error.lower()


def failed_prediction_cell(p):
    if does_not_fit(p["error"]):
        return f"does not fit: rank {p['simulated_rank']} ran out of memory"
    return f"rank {p['simulated_rank']}: {p['error'][:50]}" if p["simulated_rank"] is not None else p["error"][:60]
