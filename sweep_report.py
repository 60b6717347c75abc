"""The sweep's comparison table, and a speedup plot where matplotlib is installed, from
the lines its runs wrote: results.jsonl (one per finished run) and failures.jsonl (one
per failed run, written by run_all.sh). run_all.sh calls `python3 sweep_report.py OUT`."""

import json
import os
import sys

from tabulate import tabulate

# The article's order; strategies it does not have come after it, by name.
ORDER = ["ddp", "model_parallel", "pipeline", "hybrid", "fsdp", "tp"]
# Failure lines name the script; tensor_parallel_train.py's records say "tp".
STRATEGY_OF_SCRIPT = {"tensor_parallel": "tp"}
HEADERS = ["strategy", "GPUs", "global batch", "samples/s", "speedup", "efficiency", "MFU", "peak GiB (%)", "overhead %"]


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load(out_dir):
    """(records, failures) of one sweep, failures under their records' strategy names."""
    records = read_lines(os.path.join(out_dir, "results.jsonl"))
    failures = [{**f, "strategy": STRATEGY_OF_SCRIPT.get(f["strategy"], f["strategy"])}
                for f in read_lines(os.path.join(out_dir, "failures.jsonl"))]
    return records, failures


def run_key(run):
    return run["strategy"], run["world_size"], run["global_batch_size"]


def latest(runs):
    """One run per (strategy, world size, global batch). The files are only appended to,
    so of a run that appears twice the later line is the newer, and it replaces the other."""
    return list({run_key(run): run for run in runs}.values())


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


def table_rows(records, failures):
    """The table's rows (lists of cells, as HEADERS), in the article's order."""
    records, failures = shown(records, failures)
    base = baseline(records)

    def name(run):
        return "single-GPU baseline" if is_baseline_run(run) else run["strategy"]

    rows = []
    for r in records:
        s = speedup(r, base)
        rows.append((r, [name(r), r["world_size"], r["global_batch_size"], f"{r['samples_per_sec']:.2f}",
                         "-" if s is None else f"{s:.2f}x",
                         "-" if s is None else f"{100 * s / r['world_size']:.0f}%",
                         "-" if r["mfu"] is None else f"{r['mfu']:.1f}%",
                         f"{r['peak_mem_gib']:.2f} ({r['mem_pct']:.0f}%)", overhead(r)]))
    for f in failures:
        rows.append((f, [name(f), f["world_size"], f["global_batch_size"], f"failed: {f['error'][:60]}", "-", "-", "-", "-", "-"]))

    def order(run):
        rank = ORDER.index(run["strategy"]) if run["strategy"] in ORDER else len(ORDER)
        return rank, run["strategy"], run["world_size"], run["global_batch_size"]

    return [[str(cell) for cell in row] for _, row in sorted(rows, key=lambda pair: order(pair[0]))]


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


def main(out_dir):
    records, failures = load(out_dir)
    rows = table_rows(records, failures)
    print()
    print(tabulate(rows, headers=HEADERS, disable_numparse=True))
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True) + "\n")
    if records:
        r = records[0]
        print(f"\n{r['model']} ({r['params'] / 1e6:,.1f}M parameters), {r['seq_len']} tokens per sample, torch {r['torch_version']}, "
              f"{r['gpu_name'] or 'CPU'}. Speedup: samples/s over the single-GPU baseline; efficiency: speedup / GPUs.")
    print("The article (8x V100, 2.5B): DDP 3.73x on 4 and 6.31x on 8, model parallel 2.04x on 4, pipeline 2.63x on 4, "
          "hybrid 6.92x on 8; partly impossible (README, 'What the article claims'): contrast, do not fit.")
    print(f"Table: {out_dir}/table.md; results lines: {out_dir}/results.jsonl; logs: {out_dir}/logs/")
    if plot_speedup(records, failures, os.path.join(out_dir, "speedup.png")):
        print(f"Plot: {out_dir}/speedup.png")


if __name__ == "__main__":
    main(sys.argv[1])
