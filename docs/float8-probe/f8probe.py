"""The probe behind BENCHMARKS.md's "Float8: what else was tried for 1.25x" (issue 17): not
part of the project, kept so those figures can be rerun. It builds the 2.5b model once per
variant in one process and times STEPS steps of common.GPT with fused AdamW, clip 1.0, bf16
autocast and the compiled loss, on one fixed random batch (median of the steps after 5).

A variant's name is made of parts: bf16 | f8 (torchao tensorwise, head kept in bf16) |
row (rowwise); fast: fast accumulation in the two backward gemms too (torchao: forward
only); pow2: scales rounded to powers of 2; head: the head in float8 as well; whole: one
torch.compile of the whole model instead of one per block; nd: inductor
triton.prefer_nd_tiling; cd: inductor coordinate_descent_tuning; ma: inductor max_autotune;
lo: inductor loop_ordering_after_fusion off; mt2: triton.max_tiles 2; nc: inductor
triton.coalesce_tiling_analysis off;
split: cast_gradients_once below: each gradient's weight-gradient cast is the first cast's
float8 bytes transposed by a kernel of its own, not a second cast fused into the first
(measured no faster: BENCHMARKS.md); it stays on for every variant after it, so name split
variants last.

    pip install --no-deps --target /tmp/site torchao-0.18.0-*.whl && export PYTHONPATH=/tmp/site
    OUT=$OUT ONLY=bf16,f8,f8fast PROFILE=bf16,f8fast python3 docs/float8-probe/f8probe.py

env: ONLY (variants, in order), PROFILE (variants whose last 3 steps get a CUDA kernel
table), STEPS (12), MODEL (2.5b), DEV (cuda), BATCH (8), MICRO (1: first time the fc_in
gradient's cast alone, fused, split and under the knobs above, and write each one's kernels
to $OUT/micro_code.txt);
appends to $OUT/probe.txt."""
import functools
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


def cast_gradients_once():
    """The split variant, measured no faster (so not in common.py). Tensorwise, compiled:
    torchao 0.18 casts each linear's output gradient to float8 twice, as it is for the input
    gradient and transposed for the weight gradient (Hopper's float8 matmul takes both
    operands K-major), and inductor fuses the transposed write into the cast. One scale
    serves both casts, so their bytes agree: cast once, and transpose the float8 bytes in a
    kernel inductor cannot fuse into the cast."""
    import torchao.float8.float8_linear as float8_linear
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    cast = float8_linear.hp_tensor_to_float8_dynamic
    if getattr(cast, "casts_once", False):
        return
    transpose = _float8_transpose()
    first = {}

    def cast_once(hp, float8_dtype, mm_config, **kwargs):
        if (kwargs.get("gemm_input_role") is not GemmInputRole.GRAD_OUTPUT
                or kwargs.get("scaling_granularity") is not ScalingGranularity.TENSORWISE):
            return cast(hp, float8_dtype, mm_config, **kwargs)
        if first.get("hp") is hp:  # the weight gradient's cast of the tensor cast just before
            f = first.pop("float8")
            first.clear()
            return Float8TrainingTensor(transpose(f._data).t(), f._scale, f._orig_dtype, f._linear_mm_config,
                                        GemmInputRole.GRAD_OUTPUT)
        first.update(hp=hp, float8=cast(hp, float8_dtype, mm_config, **kwargs))
        return first["float8"]

    cast_once.casts_once = True
    float8_linear.hp_tensor_to_float8_dynamic = cast_once


@functools.cache
def _float8_transpose():
    """A custom op, so opaque to inductor, that transposes float8 bytes with a compiled kernel."""
    transpose_bytes = torch.compile(lambda x: x.t().clone(memory_format=torch.contiguous_format))

    @torch.library.custom_op("distributed_strategies::float8_transpose", mutates_args=())
    def float8_transpose(x: torch.Tensor) -> torch.Tensor:
        return transpose_bytes(x.view(torch.uint8)).view(x.dtype)

    @float8_transpose.register_fake
    def _(x):
        return x.new_empty(x.shape[1], x.shape[0])

    return float8_transpose


def micro():
    """fc_in's gradient at 2.5b (8192 x 10240): GELU backward, amax, and the two float8 casts."""
    from torch._inductor.utils import run_and_get_code

    transpose = _float8_transpose()
    m, n = BATCH * cfg.max_seq_len, 4 * cfg.d_model
    dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    pre = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    f8 = torch.float8_e4m3fn

    def cast(g):
        s = 448.0 / g.abs().max().float().clamp(min=1e-12)
        return (g.float() * s).clamp(-448, 448).to(f8)

    def bf16(dy, pre):
        return torch.ops.aten.gelu_backward(dy, pre, approximate="tanh")

    def fused(dy, pre):
        g = bf16(dy, pre)
        return cast(g), cast(g).t().contiguous()

    def split(dy, pre):
        d0 = cast(bf16(dy, pre))
        return d0, transpose(d0)

    for name, fn, knob in [("bf16 gelu backward", bf16, ""), ("fused casts", fused, ""), ("split casts", split, ""),
                           ("fused casts lo", fused, "lo"), ("fused casts mt2", fused, "mt2"),
                           ("fused casts nc", fused, "nc"), ("fused casts nd", fused, "nd")]:
        torch._dynamo.reset()
        with knobs(knob):
            cf = torch.compile(fn)
            _, code = run_and_get_code(cf, dy, pre)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "micro_code.txt"), "a") as f:
            f.write(f"##### {name}\n" + "\n".join(code) + "\n")
        for _ in range(3):
            cf(dy, pre)
        common.synchronize(DEV)
        t = time.perf_counter()
        for _ in range(50):
            cf(dy, pre)
        common.synchronize(DEV)
        say(f"MICRO {name}: {(time.perf_counter() - t) / 50 * 1e6:.1f} us")
    ref, out = torch.compile(fused)(dy, pre), torch.compile(split)(dy, pre)
    say(f"MICRO split equals fused: {all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(ref, out))}")


def build(v):
    with torch.device(DEV):
        model = common.GPT(cfg)
    model.init_weights(0)
    if v != "bf16" and not v.startswith("bf16"):
        from torchao.float8 import convert_to_float8_training

        keep = set() if "head" in v else {"head"}
        if "split" in v:  # from here on, for every variant after it too
            cast_gradients_once()
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
    if "lo" in v:
        cfg["loop_ordering_after_fusion"] = False
    if "mt2" in v:
        cfg["triton.max_tiles"] = 2
    if "nc" in v:
        cfg["triton.coalesce_tiling_analysis"] = False
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
    opt = common.make_optimizer(model, args)
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


if os.environ.get("MICRO") == "1":
    micro()
variants = os.environ.get("ONLY", "bf16,f8,f8fast,f8whole,f8fastwhole,f8pow2").split(",")
base = None
for v in filter(None, variants):
    try:
        med = run(v)
    except Exception as e:  # keep probing the others
        say(f"RESULT {v}: FAILED {type(e).__name__}: {str(e)[:300]}")
        continue
    base = base or (med if v == "bf16" else None)
    if base:
        say(f"RATIO {v}: {base / med:.3f}x")
