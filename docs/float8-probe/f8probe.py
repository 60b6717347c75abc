"""The probe behind BENCHMARKS.md's "Float8: what else was tried for 1.25x" (issue 17): not
part of the project, kept so those figures can be rerun. It builds the 2.5b model once per
variant in one process and times STEPS steps of common.GPT with fused AdamW, clip 1.0, bf16
autocast and the compiled loss, on one fixed random batch (median of the steps after 5).

A variant's name is made of parts: bf16 | f8 (torchao tensorwise, head kept in bf16) |
row (rowwise); fast: fast accumulation in the two backward gemms too (torchao: forward
only); pow2: scales rounded to powers of 2; head: the head in float8 as well; whole: one
torch.compile of the whole model instead of one per block; nd: inductor
triton.prefer_nd_tiling; cd: inductor coordinate_descent_tuning; ma: inductor max_autotune.

    pip install --no-deps --target /tmp/site torchao-0.18.0-*.whl && export PYTHONPATH=/tmp/site
    OUT=$OUT ONLY=bf16,f8,f8fast PROFILE=bf16,f8fast python3 docs/float8-probe/f8probe.py

env: ONLY (variants, in order), PROFILE (variants whose last 3 steps get a CUDA kernel
table), STEPS (12), MODEL (2.5b), DEV (cuda), BATCH (8); appends to $OUT/probe.txt."""
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common  # noqa: E402

DEV = torch.device(os.environ.get("DEV", "cuda"))
MODEL = os.environ.get("MODEL", "2.5b")
STEPS = int(os.environ.get("STEPS", "12"))
BATCH = int(os.environ.get("BATCH", "8"))
OUT = open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.txt"), "a")


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    OUT.write(s + "\n")
    OUT.flush()


sys.argv = ["x", "--model", MODEL, "--device", DEV.type, "--dtype", "bf16"]
args, cfg = common.parse_args(common.base_parser(""))


def f8config(v):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig

    if v.startswith("row"):
        c = Float8LinearConfig.from_recipe_name("rowwise")
    else:
        c = Float8LinearConfig.from_recipe_name("tensorwise")
    if "fast" in v:
        c = replace(c, gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True),
                    gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))
    if "pow2" in v:
        c = replace(c, round_scales_to_power_of_2=True)
    return c


def build(v):
    with torch.device(DEV):
        model = common.GPT(cfg)
    model.init_weights(0)
    if v != "bf16" and not v.startswith("bf16"):
        from torchao.float8 import convert_to_float8_training

        keep = set() if "head" in v else {"head"}
        convert_to_float8_training(model, config=f8config(v), module_filter_fn=lambda m, n: n not in keep)
    if "whole" in v:
        model = torch.compile(model)
    else:
        for b in model.blocks.values():
            b.compile()
    return model


def knobs(v):
    cfg = {}
    if "nd" in v:
        cfg["triton.prefer_nd_tiling"] = True
    if "cd" in v:
        cfg["coordinate_descent_tuning"] = True
    if "ma" in v:
        cfg["max_autotune"] = True
    return torch._inductor.config.patch(cfg)


def run(v):
    with knobs(v):
        return run_(v)


def run_(v):
    torch._dynamo.reset()
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    torch.cuda.reset_peak_memory_stats() if DEV.type == "cuda" else None
    t0 = time.time()
    model = build(v)
    opt = common.make_optimizer(model.parameters(), args)
    loss_fn = torch.compile(common.loss_fn)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len), generator=g).to(DEV)
    y = torch.roll(x, -1, 1)
    times, losses = [], []
    prof = None
    for step in range(STEPS):
        if step == STEPS - 3 and v in os.environ.get("PROFILE", "").split(","):
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        common.synchronize(DEV)
        s = time.perf_counter()
        with common.autocast(args, DEV):
            loss = loss_fn(model(x), y)
        loss.backward()
        common.clip_grad_norm_(opt, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        common.synchronize(DEV)
        times.append(time.perf_counter() - s)
        losses.append(loss.item())
        if step == 0:
            say(f"{v}: first step (compile) {time.time() - t0:.1f}s")
    if prof:
        prof.__exit__(None, None, None)
        say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    med = statistics.median(times[5:]) if len(times) > 6 else statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV.type == "cuda" else 0
    say(f"RESULT {v}: {med * 1000:.1f} ms/step {BATCH / med:.2f} samples/s peak {peak:.1f} GiB "
        f"losses {' '.join(f'{l:.4f}' for l in losses)} total {time.time() - t0:.0f}s")
    del model, opt
    return med


variants = os.environ.get("ONLY", "bf16,f8,f8fast,f8whole,f8fastwhole,f8pow2").split(",")
base = None
for v in variants:
    try:
        med = run(v)
    except Exception as e:  # keep probing the others
        say(f"RESULT {v}: FAILED {type(e).__name__}: {str(e)[:300]}")
        continue
    base = base or (med if v == "bf16" else None)
    if base:
        say(f"RATIO {v}: {base / med:.3f}x")
