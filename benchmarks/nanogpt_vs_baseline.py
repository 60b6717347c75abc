"""The single-GPU baseline against nanoGPT at the same shape, eager and compiled, with
both steps' kernel tables side by side: where one spends time the other does not.

    git clone https://github.com/karpathy/nanoGPT ~/nanoGPT
    python3 benchmarks/nanogpt_vs_baseline.py --nanogpt ~/nanoGPT --out results/nanogpt   # 2.5b, one GPU
    python3 benchmarks/nanogpt_vs_baseline.py --nanogpt ~/nanoGPT --out /tmp/n --model tiny --device cpu

Three runs per mode (eager; compiled):
- nanoGPT: its model.py from --nanogpt, trained as its train.py does (bias=False, tied
  head, fused AdamW from configure_optimizers, bf16 autocast, clip 1.0, TF32 on; compiled
  as one torch.compile of the whole model);
- ours: common.GPT in the same loop, with ddp_train.py's pieces (build_model, which
  compiles each block, make_optimizer, make_loss_fn, clip_grad_norm_);
- ddp_train.py itself at world size 1 (its DataLoader and bookkeeping included).
Each runs in its own process on random tokens: --warmup steps, then --steps timed, then
3 profiled. Writes compare.md (the table and the kernels whose time differs most) and
each run's full kernel table into --out."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from argparse import Namespace

import torch
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

PROFILED_STEPS = 3


def nanogpt_step(args, cfg, device):
    """nanoGPT's model and its train.py's recipe; returns step(x, y)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(args.nanogpt, "model.py"))
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    config = nano.GPTConfig(block_size=cfg.max_seq_len, vocab_size=cfg.vocab_size, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                            n_embd=cfg.d_model, dropout=0.0, bias=False)
    model = nano.GPT(config).to(device)  # built on the CPU first, as train.py does
    optimizer = model.configure_optimizers(0.1, cfg.lr, (0.9, 0.95), device.type)
    model = torch.compile(model) if args.compile else model

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def baseline_step(args, cfg, device):
    """ddp_train.py's step at world size 1, without its data loader and bookkeeping."""
    script_args = Namespace(seed=0, float8=None, activation_checkpointing=False, compile=args.compile, lr=cfg.lr, weight_decay=0.1)
    model = common.build_model(cfg, device, script_args)
    optimizer = common.make_optimizer(model, script_args)
    loss_fn = common.make_loss_fn(script_args)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        common.clip_grad_norm_(optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def kernel_times(prof, device):
    """Self time per step of each kernel (GPU) or op (CPU), in ms, by name."""
    times = {}
    for event in prof.key_averages():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if device.type == "cuda" and on_device:
            times[event.key] = event.self_device_time_total / 1000 / PROFILED_STEPS
        elif device.type == "cpu" and not on_device and event.self_cpu_time_total > 0:
            times[event.key] = event.self_cpu_time_total / 1000 / PROFILED_STEPS
    return times


def worker(args):
    """One run of one model in this process: time it, profile it, print a JSON line."""
    device = torch.device(args.device)
    cfg = common.PRESETS[args.model]
    step = (nanogpt_step if args.worker == "nanogpt" else baseline_step)(args, cfg, device)
    gen = torch.Generator(device).manual_seed(0)
    x, y = (torch.randint(cfg.vocab_size, (args.batch_size, cfg.max_seq_len), device=device, generator=gen) for _ in range(2))
    for _ in range(args.warmup):
        step(x, y)
    common.synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step(x, y)
    common.synchronize(device)
    seconds = (time.perf_counter() - start) / args.steps
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step(x, y)
        common.synchronize(device)
    name = f"{args.worker}-{'compiled' if args.compile else 'eager'}"
    with open(os.path.join(args.out, f"kernels-{name}.txt"), "w") as f:
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        f.write(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=100))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(json.dumps({"samples_per_sec": args.batch_size / seconds, "step_seconds": seconds, "peak_gib": peak,
                      "kernels_ms": kernel_times(prof, device)}))


def run_worker(args, which, compiled):
    command = [sys.executable, os.path.abspath(__file__), "--worker", which, *sys.argv[1:]] + (["--compile"] if compiled else [])
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"error: the {which} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_script(args, compiled):
    """ddp_train.py at world size 1: the baseline as users run it."""
    results = os.path.join(args.out, f"ddp_train-{'compiled' if compiled else 'eager'}.jsonl")
    if os.path.exists(results):
        os.remove(results)
    command = [sys.executable, "ddp_train.py", "--model", args.model, "--global-batch-size", str(args.batch_size), "--device", args.device,
               "--dtype", "bf16", "--steps", str(args.warmup + args.steps), "--timing-warmup-steps", str(args.warmup),
               "--log-every", str(args.warmup + args.steps), "--results", results] + (["--compile"] if compiled else [])
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    with open(results) as f:
        return json.loads(f.readline()), " ".join(["python3", *command[1:]])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", required=True, help="a nanoGPT checkout: its model.py is loaded from here")
    p.add_argument("--out", required=True, help="folder for compare.md and the kernel tables")
    p.add_argument("--model", choices=common.PRESETS, default="2.5b", help="the shape both models take (default: 2.5b)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step (default: 8)")
    p.add_argument("--warmup", type=int, default=5, help="steps before timing (default: 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--worker", choices=["nanogpt", "ours"], help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.nanogpt, "model.py")):
        p.error(f"--nanogpt {args.nanogpt} holds no model.py: give the folder of a nanoGPT checkout")
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args)

    cfg = common.PRESETS[args.model]
    flops = common.flops_per_token(cfg, cfg.max_seq_len) * cfg.max_seq_len
    peak, peak_source = common.peak_tflops(torch.device(args.device), "bf16")
    rows, kernels, commands = [], {}, []
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        nano, ours = run_worker(args, "nanogpt", compiled), run_worker(args, "ours", compiled)
        script, command = run_script(args, compiled)
        commands.append(command)
        kernels[mode] = (nano["kernels_ms"], ours["kernels_ms"])
        for name, r in (("nanoGPT", nano), ("common.GPT, same loop", ours)):
            mfu = common.mfu_pct(flops * args.batch_size, r["step_seconds"], peak, 1)
            rows.append((name, mode, f"{r['samples_per_sec']:.2f}", f"{r['samples_per_sec'] / nano['samples_per_sec']:.3f}x",
                         "n/a" if mfu is None else f"{mfu:.1f}%", "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"))
        rows.append(("ddp_train.py, world size 1", mode, f"{script['samples_per_sec']:.2f}",
                     f"{script['samples_per_sec'] / nano['samples_per_sec']:.3f}x",
                     "n/a" if script["mfu"] is None else f"{script['mfu']:.1f}%", f"{script['peak_mem_gib']:.1f} (reserved)"))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [f"{device} | torch {torch.__version__} | --model {args.model} | batch {args.batch_size} x {cfg.max_seq_len} | "
             f"{args.warmup} warm-up steps, {args.steps} timed | MFU peak: {peak_source} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             tabulate(rows, ["run", "mode", "samples/s", "vs nanoGPT", "MFU", "peak GiB"], tablefmt="github"), "",
             "ddp_train.py commands: " + "; ".join(f"`{c}`" for c in commands)]
    for mode, (nano, ours) in kernels.items():
        diffs = sorted(set(nano) | set(ours), key=lambda k: -abs(ours.get(k, 0) - nano.get(k, 0)))[:25]
        table = [(k[:90], f"{nano.get(k, 0):.2f}", f"{ours.get(k, 0):.2f}", f"{ours.get(k, 0) - nano.get(k, 0):+.2f}") for k in diffs]
        table.append(("all", f"{sum(nano.values()):.2f}", f"{sum(ours.values()):.2f}", f"{sum(ours.values()) - sum(nano.values()):+.2f}"))
        lines += ["", f"### {mode}: the kernels whose time per step differs most (ms)", "",
                  tabulate(table, ["kernel" if args.device == "cuda" else "op", "nanoGPT", "ours", "ours - nanoGPT"], tablefmt="github")]
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
