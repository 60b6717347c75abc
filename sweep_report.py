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
    python3 sweep_report.py --best OUT SCRIPT N BATCH         # run_all.sh: the fastest settings tried

Its parts live in sweep/ (see sweep/__init__.py): the lines read and checked, the
predictions, the settings chosen, the plan and the pictures."""

import argparse
import filecmp
import os
import shutil
import sys

from tabulate import tabulate

import common
from sweep.lines import PREDICTED, STRATEGY_OF_SCRIPT, InputError, baseline, is_baseline_run, load, name_of, on_gpus, order_key, run_key, speedup
from sweep.pictures import PART_STYLE, PICTURES, describe, draw_pictures, figures
from sweep.plan import parse_spec, plan, plan_line
from sweep.predict import SPLIT_PARTS, link_bandwidth
from sweep.settings import (candidate_predictions, choose, does_not_fit, failed_prediction_cell, flags_of, measured_tried, predicted_rate,
                            predictions, shown)

# The lines a report is built from; --into keeps copies of them beside it.
LINE_FILES = ("results.jsonl", "simulated.jsonl", "failures.jsonl")


# ----------------------------------------------------------------------------
# The table and the verdict
# ----------------------------------------------------------------------------


def overhead(record):
    """What keeps this strategy from scaling, as it measured it."""
    if record.get("comm_pct") is not None:
        return f"comm {record['comm_pct']:.1f}"
    if record.get("bubble_pct") is not None:
        return f"bubble {record['bubble_pct']:.1f}"
    if record.get("utilisation_pct") is not None:
        return f"idle {100 - record['utilisation_pct']:.1f}"
    return "-"


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
# The report: REPORT.md, the numbers of its pictures in tables, and the settings tried
# ----------------------------------------------------------------------------


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


def write_report(into, records, failures, simulated, sim_failures, bandwidth, table, notes, link=True, skipped=()):
    """REPORT.md and, with matplotlib, the five pictures, in folder `into`; returns the pictures' paths."""
    data = figures(records, failures, simulated, sim_failures, bandwidth)
    meta = describe(shown(records, failures)[0], simulated)
    pictures = draw_pictures(data, meta, into) if records or simulated else {}
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


# ----------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """A usage error in one line, as every other refusal."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def prepare_into(into, out_dir, given):
    """The folder the table and report go into, made where --into names a new one; an
    InputError if it cannot take them. Returns the lines files to copy there (--into a
    folder other than the sweep's)."""
    option = f"--into {into}" if given else out_dir
    if os.path.exists(into) and not os.path.isdir(into):
        raise InputError(f"{option} is not a folder")
    try:
        os.makedirs(into, exist_ok=True)
    except OSError as e:
        raise InputError(f"{option} cannot be made: {e.strerror or e}") from None
    if not os.access(into, os.W_OK | os.X_OK):
        raise InputError(f"{option} is not writable" + ("" if given else ": write the table and report elsewhere with --into DIR"))
    copies = LINE_FILES if given and os.path.realpath(into) != os.path.realpath(out_dir) else ()
    for name in ("table.md", "REPORT.md", *PICTURES.values(), *copies):
        path = os.path.join(into, name)
        # Opening a FIFO to write waits for a reader forever; a device or folder takes nothing.
        if os.path.lexists(path) and not os.path.isfile(path):
            raise InputError(f"cannot write into {into}: {path} is not a regular file"
                             + ("; write them elsewhere with --into DIR" if not given else "; remove it or name another folder"))
    for name in copies:  # another sweep's lines may be the only copy of them: never replaced
        mine, theirs = os.path.join(out_dir, name), os.path.join(into, name)
        if os.path.exists(theirs) and not (os.path.exists(mine) and filecmp.cmp(mine, theirs, shallow=False)):
            raise InputError(f"--into {into} holds a {name} that is not {out_dir}'s (another sweep's lines): "
                             "name a folder of its own, or remove it first")
    return copies


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
    copies = prepare_into(into, out_dir, args.into is not None)
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
        for name in copies:
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
