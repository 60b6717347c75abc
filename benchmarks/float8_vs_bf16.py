"""bf16 against float8 on one GPU: the same training run (the 2.5b preset, compiled, on a
real token file) once per precision, and what float8 changes: samples/s, peak memory,
and the loss where the runs end.

    python3 benchmarks/float8_vs_bf16.py --out results/float8            # 2.5b, 300 steps, both recipes
    python3 benchmarks/float8_vs_bf16.py --model 350m --steps 50 --recipes tensorwise

Every run is `ddp_train.py` at world size 1 with --compile (float8 is slower than bf16
without it). The token file is --data, or, by default, the bytes of this Python's standard
library sources: real text every machine has, no download. Losses are compared as the
mean of the last 10 steps, which one step's noise does not move."""

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stdlib_tokens(path, n_tokens):
    """The first n_tokens bytes of the standard library's .py files (sorted by path), as uint16 ids."""
    chunks, total = [], 0
    for source in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        with open(source, "rb") as f:
            chunks.append(np.frombuffer(f.read(), dtype=np.uint8))
        total += len(chunks[-1])
        if total >= n_tokens:
            break
    np.concatenate(chunks)[:n_tokens].astype(np.uint16).tofile(path)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a folder for the logs and results lines (created)")
    p.add_argument("--model", default="2.5b")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--recipes", default="tensorwise,rowwise", help="float8 recipes to run beside bf16, comma-separated")
    p.add_argument("--data", help="a uint16 token file (default: made from the standard library's sources)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "results.jsonl")
    data = args.data or stdlib_tokens(os.path.join(args.out, "stdlib.bin"), 4 * 2**20)

    runs = {}
    for name in ["bf16", *args.recipes.split(",")]:
        command = [sys.executable, os.path.join(ROOT, "ddp_train.py"), "--model", args.model, "--steps", str(args.steps),
                   "--global-batch-size", str(args.global_batch_size), "--data", data, "--compile", "--results", results]
        command += [] if name == "bf16" else ["--float8", name]
        print(" ".join(command), flush=True)
        with open(os.path.join(args.out, f"{name}.log"), "w") as log:
            status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        if status != 0:
            print(f"{name}: failed with exit status {status}, see {log.name}")
            continue
        with open(results) as f:
            runs[name] = json.loads(f.readlines()[-1])

    base = runs.get("bf16")
    rows = []
    for name, r in runs.items():
        loss = float(np.mean(r["losses"][-10:]))
        rows.append([name, f"{r['samples_per_sec']:.2f}", f"{r['samples_per_sec'] / base['samples_per_sec']:.3f}x" if base else "-",
                     f"{r['mfu']:.1f}%" if r["mfu"] is not None else "-", f"{r['peak_mem_gib']:.1f} ({r['mem_pct']:.0f}%)",
                     f"{r['peak_mem_gib'] / base['peak_mem_gib']:.0%}" if base else "-", f"{loss:.4f}",
                     f"{100 * (loss / float(np.mean(base['losses'][-10:])) - 1):+.2f}%" if base else "-"])
    sample = next(iter(runs.values()), None)
    if sample:
        print(f"\n{sample['model']}, {sample['gpu_name']}, torch {sample['torch_version']}, batch {sample['global_batch_size']} x "
              f"{sample['seq_len']}, {sample['steps']} steps, compiled; MFU against the bf16 peak")
    print(tabulate(rows, headers=["run", "samples/s", "vs bf16", "MFU", "peak GiB", "vs bf16", "loss (last 10)", "vs bf16"],
                   tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
