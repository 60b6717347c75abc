"""Does tensor parallelism split the work? On one GPU: a simulated tensor-parallel rank's
step at tp 1, 2 and 4 (plain and with --sequence-parallel), compiled, beside the compiled
DDP baseline, and the share of a profiled tp-4 step its GPU is busy. Issue 39's bars: a
tp-2 rank's step at most 0.6x of tp 1's, tp 4's at most 0.4x, its GPU busy at least 90%.

    python benchmarks/tp_scaling.py --out results/tp-scaling          # 2.5b, a few minutes
    python benchmarks/tp_scaling.py --out results/tp32 --global-batch-size 32 --one-gpu-grad-accum 4
                                                                      # the sweep's job at 4 GPUs
    python benchmarks/tp_scaling.py --gpu-busy results/x/profile        # only read a trace folder

Every run appends its results line to OUT/results.jsonl and its output to OUT/<run>.log.
"""

import argparse
import glob
import gzip
import json
import os
import subprocess
import sys

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_busy_pct(folder):
    """The share of the profiled steps' wall time in which the GPU ran something (kernels,
    copies, sets: the union of their intervals), from rank 0's Chrome trace in `folder`."""
    path = next(iter(sorted(glob.glob(os.path.join(folder, "trace_rank0.json*")))))
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"]
    start, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, reach = 0.0, start
    for s, e in spans:
        s, e = max(s, reach), min(e, end)
        if e > s:
            busy += e - s
            reach = e
    return 100 * busy / (end - start)


def run(name, script, args, out):
    """One run of a script, its results line appended to OUT/results.jsonl; returns the record."""
    results = os.path.join(out, "results.jsonl")
    before = sum(1 for _ in open(results)) if os.path.exists(results) else 0
    cmd = [sys.executable, os.path.join(ROOT, script), *args, "--results", results]
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    lines = open(results).read().splitlines() if os.path.exists(results) else []
    record = json.loads(lines[-1]) if code == 0 and len(lines) > before else None
    print(f"{name}: " + (f"exit {code}" if record is None else f"{1000 * record['step_seconds']:.1f} ms a step"), flush=True)
    return record


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for the results, logs and the tp-4 profile (made if missing)")
    p.add_argument("--model", default="2.5b")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--one-gpu-grad-accum", type=int, default=1, metavar="N",
                   help="the DDP baseline and tp 1 step the same batch in N micro-steps (2.5b at 32 samples does not fit 80 GiB in one pass)")
    p.add_argument("--variants", default="plain,sp", help="which of plain and sp (--sequence-parallel) to run (default: both)")
    p.add_argument("--gpu-busy", metavar="DIR", help="only print the GPU busy share of the trace in DIR")
    args = p.parse_args()
    if args.gpu_busy:
        print(f"GPU busy {gpu_busy_pct(args.gpu_busy):.1f}% of the profiled steps")
        return
    if not args.out:
        p.error("--out DIR is needed")
    os.makedirs(args.out, exist_ok=True)
    base = ["--model", args.model, "--steps", str(args.steps), "--global-batch-size", str(args.global_batch_size), "--compile"]
    rows, records = [], {}
    one_gpu = ["--grad-accum", str(args.one_gpu_grad_accum)]
    records["ddp x1"] = run("ddp_x1", "ddp_train.py", [*base, *one_gpu], args.out)
    for sp in [[] if v == "plain" else ["--sequence-parallel"] for v in args.variants.split(",")]:
        for tp in (1, 2, 4):
            name = f"tp {tp}{' sp' if sp else ''}"
            sim = one_gpu if tp == 1 else ["--simulate", str(tp)]
            records[name] = run(name.replace(" ", "_"), "tensor_parallel_train.py", [*base, *sim, *sp], args.out)
    profile = os.path.join(args.out, "profile_tp4")
    records["tp 4 profiled"] = run("tp_4_profiled", "tensor_parallel_train.py", [*base, "--simulate", "4", "--profile", profile], args.out)
    for name, record in records.items():
        tp1 = records.get("tp 1 sp" if name.endswith("sp") else "tp 1")
        ratio = None if record is None or tp1 is None else record["step_seconds"] / tp1["step_seconds"]
        rows.append([name, None if record is None else 1000 * record["step_seconds"], ratio,
                     None if record is None else record["peak_mem_gib"]])
    print(tabulate(rows, ["run", "step ms", "step / tp 1's", "peak GiB"], floatfmt=".3f"))
    if records["tp 4 profiled"] is not None:
        print(f"tp 4: GPU busy {gpu_busy_pct(profile):.1f}% of the profiled steps")


if __name__ == "__main__":
    main()
