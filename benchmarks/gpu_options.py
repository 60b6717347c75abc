"""Every strategy at world size 1 with each option that can run on one GPU: each case must
exit 0 with finite losses, and an interrupted run resumed from its checkpoint must go on
as the uninterrupted run did (within bf16's noise). CI has no GPU; this is the check for
a GPU machine, where CUDA, NCCL, compile and float8 kernels run for real.

    python3 benchmarks/gpu_options.py --out results/gpu-options             # every case, tiny preset
    python3 benchmarks/gpu_options.py --out /tmp/m --only pipeline,hybrid --jobs 2

A case is one launch of a script with the options of its row; the options of a larger
job (--comm-hook, --dp, --pp 2, --cp 2, sequence parallelism over ranks) run as one rank
of it through --simulate. Each strategy also gets a checkpoint case: an uninterrupted
run, a run sent SIGTERM after step 3 (it must save and exit 0; torchrun passing the
signal on is tested on the CPU, tests/test_checkpoint.py), and its resume from that checkpoint, whose losses must match the uninterrupted run's.
Writes matrix.md (the table) and logs/ (each case's output) into --out; exits 1 if any
case failed. On a machine without a GPU the cases that need one are listed as skipped."""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"ddp": "ddp_train.py", "fsdp": "fsdp_train.py", "tensor_parallel": "tensor_parallel_train.py",
           "model_parallel": "model_parallel_train.py", "pipeline": "pipeline_train.py", "hybrid": "hybrid_train.py",
           "context_parallel": "context_parallel_train.py"}
BASE = {"hybrid": ["--pp", "1"]}  # hybrid's default --pp 2 needs two ranks
FP16_REFUSED = {"fsdp", "tensor_parallel", "model_parallel", "pipeline", "hybrid", "context_parallel"}  # they say why in one line
CHECKPOINT_STEPS = 100
RESUME_RTOL = 1e-2  # bf16 keeps 8 bits of mantissa, and GPU kernels add up in no fixed order

# Options every script takes; {data}, {dir} are filled in per case.
COMMON = [[], ["--compile"], ["--activation-checkpointing"], ["--grad-accum", "2"], ["--dtype", "fp32"], ["--dtype", "fp16"],
          ["--float8", "tensorwise", "--compile"], ["--float8", "rowwise", "--compile"], ["--data", "{data}"], ["--num-workers", "0"],
          ["--profile", "{dir}/profile"], ["--tensorboard", "{dir}/tensorboard"], ["--simulate", "2"], ["--count-comm", "--compile"],
          ["--checkpoint-every", "3", "--checkpoint-dir", "{dir}/checkpoints"]]
SPECIFIC = {
    "ddp": [["--simulate", "2", "--comm-hook", "bf16"], ["--simulate", "2", "--comm-hook", "fp16"]],
    "fsdp": [["--cpu-offload"], ["--no-reshard-after-forward"], ["--simulate", "2", "--cpu-offload"]],
    "tensor_parallel": [["--sequence-parallel"], ["--simulate", "2", "--sequence-parallel"], ["--simulate", "4", "--dp", "2"],
                        ["--simulate", "2", "--sequence-parallel", "--float8", "tensorwise"]],
    "model_parallel": [["--simulate", "2", "--split", "3,5"]],
    "pipeline": [["--schedule", "gpipe"], ["--schedule", "1f1b", "--micro-batches", "8"],
                 ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2"], ["--schedule", "zero-bubble", "--stages-per-rank", "2"],
                 ["--schedule", "zbv", "--stages-per-rank", "2"], ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--split", "3,5"],
                 ["--simulate", "2", "--schedule", "interleaved-1f1b"]],
    "hybrid": [["--dp-wrapper", "ddp"], ["--mesh-order", "dp-pp"], ["--schedule", "zbv", "--stages-per-rank", "2"],
               ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--split", "3,5"],
               ["--simulate", "4", "--pp", "2"], ["--simulate", "4", "--pp", "2", "--dp-wrapper", "ddp", "--mesh-order", "dp-pp"]],
    "context_parallel": [["--cp-impl", "torch"], ["--simulate", "2", "--cp-impl", "torch"], ["--simulate", "4", "--cp", "2"]],
}
# What only a GPU runs: the case is skipped elsewhere.
NEEDS_GPU = [("--dtype", "fp16"), ("--cp-impl", "torch")]
# Options no case above names, and why one GPU has nothing to show of them.
NOT_HERE = {
    "--device": "auto picks the GPU in every case",
    "--timeout": "only acts when a peer dies or stalls: the CPU tests kill and stall ranks (tests/test_errors.py)",
    "--simulate-rank": "rank 0 is simulated; other ranks run the same code on the same one device",
    "--powersgd-start-iter": "PowerSGD cannot be simulated (its factors depend on data the fake peers never send) and needs two GPUs",
    "--reshard-after-forward": "the default; --no-reshard-after-forward is the case",
    "--help": "argparse's own",
}
# Options every case passes, or numbers that change no code path.
ALWAYS = ["--model", "--steps", "--global-batch-size", "--seq-len", "--results", "--log-every", "--checkpoint-dir", "--vocab-size",
          "--lr", "--lr-warmup-steps", "--weight-decay", "--grad-clip", "--seed", "--timing-warmup-steps", "--micro-batches"]


def cases(strategies):
    """Compiled cases first: they take longest, so they should not start last."""
    every = [(s, BASE.get(s, []) + options) for s in strategies for options in COMMON + SPECIFIC.get(s, [])]
    return sorted(every, key=lambda case: "--compile" not in case[1])


def needs_gpu(options):
    return any(a == option and b == value for option, value in NEEDS_GPU for a, b in zip(options, options[1:]))


def run_case(strategy, options, args, name, steps, sigterm_after=None, checkpoint_dir=None):
    """One launch; returns (outcome, seconds, the results record or None)."""
    case_dir = os.path.join(args.out, "cases", name)
    os.makedirs(case_dir, exist_ok=True)
    options = [o.format(data=args.data, dir=case_dir) for o in options]
    results = os.path.join(case_dir, "results.jsonl")
    if os.path.exists(results):
        os.remove(results)
    command = [sys.executable, os.path.join(ROOT, SCRIPTS[strategy]), "--model", args.model, "--steps", str(steps),
                          "--results", results, *options] + (["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else [])
    start = time.perf_counter()
    with open(os.path.join(args.out, "logs", f"{name}.log"), "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        signalled = False
        for line in proc.stdout:
            log.write(line)
            if sigterm_after and not signalled and re.match(rf"step +{sigterm_after}/", line):
                proc.send_signal(signal.SIGTERM)  # a scheduler's time limit
                signalled = True
        code = proc.wait()
    seconds = time.perf_counter() - start
    record = None
    if os.path.exists(results):
        with open(results) as f:
            record = json.loads(f.readlines()[-1])
    if code != 0:
        return f"FAIL: exit {code}", seconds, record
    if record is None:
        return "FAIL: no results line", seconds, None
    if sigterm_after is None and len(record["losses"]) != steps - record["start_step"]:  # a stopped run: checkpoint_case checks it
        return f"FAIL: {len(record['losses'])} losses for {steps - record['start_step']} steps", seconds, record
    # A simulated rank computes on buffers no peer filled: its losses mean nothing (NaN too).
    if record["simulated_rank"] is None and not all(np.isfinite(record["losses"])):
        return "FAIL: a loss is not finite", seconds, record
    return "pass", seconds, record


def refused_fp16(strategy, options, args, name):
    """fp16 where a strategy refuses it: the case passes if the refusal is one line, exit 2."""
    command = [sys.executable, os.path.join(ROOT, SCRIPTS[strategy]), "--model", args.model, *options]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    with open(os.path.join(args.out, "logs", f"{name}.log"), "w") as log:
        log.write(" ".join(command) + "\n" + proc.stdout + proc.stderr)
    ok = proc.returncode == 2 and proc.stderr.strip().startswith("error: --dtype fp16 is not supported here")
    return ("pass (refused by design)" if ok else f"FAIL: exit {proc.returncode}"), 0.0, None


def checkpoint_case(strategy, args):
    """Uninterrupted, SIGTERM after step 3, resume: the resume must continue as the uninterrupted run.
    Enough steps that the signal lands long before the end."""
    base, steps = BASE.get(strategy, []), CHECKPOINT_STEPS
    folder = os.path.join(args.out, "cases", f"{strategy}-checkpoints")
    shutil.rmtree(folder, ignore_errors=True)
    with ThreadPoolExecutor(2) as pool:  # independent runs: side by side
        uninterrupted = pool.submit(run_case, strategy, base, args, f"{strategy}-uninterrupted", steps)
        stopped = run_case(strategy, base, args, f"{strategy}-sigterm", steps, sigterm_after=3, checkpoint_dir=folder)
        whole = uninterrupted.result()
    resumed = run_case(strategy, base, args, f"{strategy}-resume", steps, checkpoint_dir=folder)
    rows = [(strategy, "checkpoint: uninterrupted", *whole[:2]), (strategy, "checkpoint: SIGTERM after step 3, saves", *stopped[:2])]
    outcome = resumed[0]
    if outcome == "pass":
        start, losses = resumed[2]["start_step"], resumed[2]["losses"]
        expected = whole[2]["losses"][start:] if whole[2] else []
        if not 3 <= start < steps or stopped[2] is None or len(stopped[2]["losses"]) != start:
            outcome = f"FAIL: resumed at step {start}, not where SIGTERM stopped it"
        elif len(losses) != len(expected) or not np.allclose(losses, expected, rtol=RESUME_RTOL, atol=0):
            outcome = f"FAIL: losses {losses} != uninterrupted {expected}"
    rows.append((strategy, "checkpoint: resume matches the uninterrupted run", outcome, resumed[1]))
    return rows


def fresh_out(out):
    """An --out of an earlier matrix starts empty: its cases' checkpoints would make a case
    resume, with nothing left to train, and its outcomes would run on into this run's."""
    for name in ("cases", "logs"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    for name in ("outcomes.jsonl", "matrix.md"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    os.makedirs(os.path.join(out, "logs"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for matrix.md, logs/ and each case's files")
    p.add_argument("--model", default="tiny", help="size preset (default: tiny, so every case ends in seconds)")
    p.add_argument("--steps", type=int, default=8, help="steps per case, at least 7 for --profile (default: 8)")
    p.add_argument("--only", help="comma-separated strategies (default: all)")
    p.add_argument("--jobs", type=int, default=4, help="cases run at once on the one GPU (default: 4)")
    args = p.parse_args()
    strategies = args.only.split(",") if args.only else list(SCRIPTS)
    unknown = [s for s in strategies if s not in SCRIPTS]
    if unknown or args.steps < 7 or args.jobs < 1:
        p.error(f"--only takes {', '.join(SCRIPTS)}" if unknown else "--steps must be at least 7 and --jobs at least 1")
    fresh_out(args.out)
    args.data = os.path.join(args.out, "tokens.bin")
    np.random.default_rng(0).integers(0, 512, 1 << 16).astype(np.uint16).tofile(args.data)  # tiny's vocabulary is 512
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None

    def one(case):
        strategy, options = case
        name = re.sub(r"[^A-Za-z0-9.,=-]+", "_", f"{strategy}-{'-'.join(options) or 'default'}").strip("_")
        shown = " ".join(o.replace("{data}", "tokens.bin").replace("{dir}/", "") for o in options) or "(defaults)"
        if needs_gpu(options) and gpu is None:
            row = strategy, shown, "skipped: needs a GPU", 0.0
        elif ["--dtype", "fp16"] == options[-2:] and strategy in FP16_REFUSED:
            row = (strategy, shown, *refused_fp16(strategy, options, args, name)[:2])
        else:
            row = (strategy, shown, *run_case(strategy, options, args, name, args.steps)[:2])
        progress(row)
        return row

    def progress(row):
        """Each outcome as it comes, so a run cut short still shows what it got through."""
        with lock, open(os.path.join(args.out, "outcomes.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    lock = threading.Lock()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, cases(strategies)))
        for checkpoint_rows in pool.map(lambda s: checkpoint_case(s, args), strategies):
            for row in checkpoint_rows:
                progress(row)
            rows += checkpoint_rows
    failed = [row for row in rows if row[2].startswith("FAIL")]
    header = (f"{len(rows)} cases, {len(failed)} failed | {gpu or 'no GPU (CPU, gloo)'} | torch {torch.__version__} | "
              f"--model {args.model} --steps {args.steps} | started {started}")
    table = tabulate([(s, o, outcome, f"{sec:.1f}") for s, o, outcome, sec in rows], ["strategy", "options", "outcome", "s"], tablefmt="github")
    with open(os.path.join(args.out, "matrix.md"), "w") as f:
        f.write(header + "\n\n" + table + "\n")
    print(table + "\n\n" + header)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
