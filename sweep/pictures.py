"""The report's five pictures (matplotlib, where installed). figures() takes every number a
picture shows from the results lines (the tests read them there); draw_* only draw them."""

import os

from sweep.lines import PREDICTED, baseline, name_of, on_gpus, order_key, run_key, speedup
from sweep.predict import roles_of, step_split, wire_bytes
from sweep.settings import failed_prediction_cell, predictions, shown


# The article's points (8x V100, 2.5B): (strategy, GPUs, speedup); contrasted, never fitted.
ARTICLE = [("ddp", 1, 1.0), ("ddp", 4, 3.73), ("ddp", 8, 6.31), ("model_parallel", 4, 2.04), ("pipeline", 4, 2.63), ("hybrid", 8, 6.92)]
PICTURES = {"speedup": "speedup.png", "split": "step_split.png", "loss": "loss.png", "memory": "memory.png", "comm": "communication.png"}
# Each part of a step: its label, a grey and a hatch, so that it reads in black and white.
PART_STYLE = {"data": ("data wait", "0.97", ".."), "compute": ("compute", "0.6", ""), "comm": ("exposed communication", "0.85", "//"),
              "bubble": ("bubble: waiting for other stages", "1.0", "xx"), "optimizer": ("optimizer step", "0.35", ""),
              "rest": ("rest: zero_grad, loss all-reduce, sync", "0.9", "--")}
MARKERS = {"ddp": "o", "model_parallel": "s", "pipeline": "^", "hybrid": "D", "fsdp": "v", "tp": "P"}
LINES = ["-", "--", "-.", ":"]


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


def _save(plt, fig, title, meta, missing, path):
    # Laid out once, with room above for the two title lines and below for what is missing,
    # and saved as laid out (bbox_inches="tight" would draw each picture twice more).
    fig.tight_layout(rect=(0, 0.09 if missing else 0, 1, 0.89))
    fig.suptitle(f"{title}\n{meta}", fontsize=10, wrap=True)
    if missing:
        fig.text(0.01, 0.01, "missing (not drawn): " + "; ".join(f"{m['name']} {m['why']}" for m in missing)[:300],
                 fontsize=7, va="bottom", wrap=True)
    fig.savefig(path, dpi=100)
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


def draw_pictures(data, meta, into):
    """The five pictures of figures()' numbers, in folder `into`: {picture: its path}; none without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return {}
    paths = {}
    for key, draw_one in DRAW.items():
        paths[key] = os.path.join(into, PICTURES[key])
        draw_one(plt, data[key], meta, paths[key])
    return paths
