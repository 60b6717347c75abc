"""Data parallel training with DistributedDataParallel, and the single-GPU baseline.

Every rank holds a full replica of the model and trains on its own slice of each global
batch. During backward, DDP averages the gradients across ranks with ring all-reduces,
bucket by bucket, overlapped with the rest of the backward pass, so every replica takes
the same optimizer step. At world size 1 the model is not wrapped at all: that run is the
baseline every other strategy's speed-up is divided by.

Launch:
    python ddp_train.py                                          # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=8 ddp_train.py --model 2.5b --global-batch-size 64
    # two nodes of 8 GPUs: run on each node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \\
        --rdzv_id=job1 ddp_train.py --model 2.5b --global-batch-size 128
"""

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import common


# NVLink bandwidth per GPU and direction from the datasheets (SXM parts), to read the
# measured bus bandwidth against. PCIe and NVL cards depend on their bridges, and across
# nodes the network card is the bound instead.
NVLINK_GBPS = [("H200", 450), ("H100", 450), ("A100", 300), ("V100", 150)]


def nvlink_gbps(device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    if "pcie" in name.lower() or "nvl" in name.lower():
        return None
    return next((gbps for key, gbps in NVLINK_GBPS if key in name), None)


def bf16_compress(state, bucket):
    # default_hooks.bf16_compress_hook under another name: DDP refuses that name unless it
    # finds NCCL, but gloo reduces bf16 just as well.
    return default_hooks.bf16_compress_hook(state, bucket)


def powersgd_bucket_by_bucket(state, bucket):
    # PowerSGD chains all-reduces in future callbacks, which gloo runs on its own threads:
    # two buckets' chains can then interleave in a different order on each rank, and gloo
    # fails with a size mismatch. Finishing each bucket before the next keeps the order.
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future


def register_comm_hook(model, args):
    """Compress gradients on the wire (the article's communication-hook advice)."""
    if args.simulate:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.comm_hook, torch.float32)
        model.register_comm_hook(None, common.option("simulate").allreduce_hook(dtype))
    elif args.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.comm_hook == "bf16":
        model.register_comm_hook(None, bf16_compress)
    elif args.comm_hook == "powersgd":
        # Rank-4 low-rank approximation with error feedback; plain all-reduce for the first
        # start_powerSGD_iter synchronised steps, while gradients change fastest.
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=args.powersgd_start_iter)
        gloo = dist.get_backend() == "gloo"
        model.register_comm_hook(state, powersgd_bucket_by_bucket if gloo else powerSGD_hook.powerSGD_hook)


def forward_backward(model, loss_fn, x, y, args, device, scaler, sync=True):
    """One micro-step. Forward AND backward sit under no_sync(): DDP decides during the
    forward pass whether the coming backward all-reduces."""
    with nullcontext() if sync else model.no_sync():
        with common.autocast(args, device):
            loss = loss_fn(model(x), y) / args.grad_accum
        scaler.scale(loss).backward()
    return loss.detach()


def measure_communication(model, loss_fn, batches, args, env, scaler, n=3):
    """Exposed communication, measured in this run instead of read off a profiler by hand:
    n forward+backward passes with DDP's all-reduce against n under no_sync() (compute
    only), both one synchronised micro-step's worth. The difference is the communication
    that backward did not hide, as a share and in seconds. Beside it, the bus bandwidth
    of a separately timed all-reduce of fp32 gradients (at most 1 GiB of them: a large
    model's whole gradient again could run out of memory after training)."""

    def timed(fn):
        common.synchronize(env.device)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        common.synchronize(env.device)
        return (time.perf_counter() - start) / n

    def step(sync):
        x, y = next(batches)
        forward_backward(model, loss_fn, x, y, args, env.device, scaler, sync)
        model.zero_grad(set_to_none=True)

    synced = timed(lambda: step(True))
    compute = timed(lambda: step(False))
    grads = torch.empty(min(2**28, sum(p.numel() for p in model.parameters())), device=env.device)
    dist.all_reduce(grads)  # warm-up
    seconds = timed(lambda: dist.all_reduce(grads))
    return exposed_comm_pct(synced, compute), allreduce_busbw_gbps(grads.numel() * 4, env.world_size, seconds), max(0.0, synced - compute)


def exposed_comm_pct(synced_seconds, compute_seconds):
    """The share of a synchronised step that communication added on top of compute."""
    return max(0.0, 100 * (1 - compute_seconds / synced_seconds))


def allreduce_busbw_gbps(nbytes, n_ranks, seconds):
    """nccl-tests' bus bandwidth: a ring all-reduce moves 2(n-1)/n of the buffer per rank."""
    return nbytes * 2 * (n_ranks - 1) / n_ranks / seconds / 1e9


def main():
    parser = common.base_parser(__doc__)
    parser.add_argument("--comm-hook", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                        help="compress gradients before the all-reduce (default: none); all work on NCCL and gloo")
    parser.add_argument("--powersgd-start-iter", type=common.number(int, 2, accepted="a whole number of at least 2 (PowerSGD's error feedback needs it)"), default=10,
                        help="with --comm-hook powersgd: plain all-reduce for this many optimizer steps first; at least 2 (default: 10)")
    args, cfg = common.parse_args(parser)
    env = common.init_distributed(args)
    common.check(args.global_batch_size % (env.world_size * args.grad_accum) == 0,
                 f"--global-batch-size {args.global_batch_size} must divide evenly over {env.world_size} ranks x --grad-accum {args.grad_accum}")
    common.check(args.comm_hook == "none" or env.world_size > 1, "--comm-hook needs more than one rank: at world size 1 nothing is communicated")
    common.check(not (args.simulate and args.comm_hook == "powersgd"), "--comm-hook powersgd cannot be simulated: its factors depend on data the fake peers never send")
    common.check(args.comm_hook != "powersgd" or args.powersgd_start_iter < args.steps, f"--powersgd-start-iter {args.powersgd_start_iter} "
                 f"is not below --steps {args.steps}: PowerSGD would never start (lower it, or raise --steps)")

    # Every rank builds the same full model from the same seed.
    raw_model = common.build_model(cfg, env.device, args)
    loss_fn = common.make_loss_fn(args)
    model = raw_model
    if env.world_size > 1:
        model = DDP(raw_model, device_ids=[env.local_rank] if env.device.type == "cuda" else None, gradient_as_bucket_view=True)
        register_comm_hook(model, args)

    optimizer = common.make_optimizer(raw_model, args)
    scaler = torch.amp.GradScaler(env.device.type, enabled=args.dtype == "fp16")  # a no-op unless fp16
    ckpt = common.checkpointer(args, cfg, raw_model, optimizer, scaler if scaler.is_enabled() else None)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return

    micro_batch = args.global_batch_size // (env.world_size * args.grad_accum)
    batches = common.make_batches(args, cfg, env.device, micro_batch, env.rank, env.world_size, start_step)
    tlog = common.TrainLog(args, env, cfg, "ddp", optimizer, start_step, hooks=[ckpt])
    batches = tlog.timed_batches(batches)
    stop = False
    for step in tlog.steps():
        lr = common.set_lr(optimizer, step, args)
        loss = torch.zeros((), device=env.device)
        for micro in range(args.grad_accum):
            x, y = next(batches)
            # Only the last micro-step all-reduces: accumulation saves communication.
            last = micro == args.grad_accum - 1
            loss += forward_backward(model, loss_fn, x, y, args, env.device, scaler, sync=last or env.world_size == 1)
        scaler.unscale_(optimizer)
        grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        # This rank's loss is the mean over its G/world samples; the shares sum to the global mean.
        stop = tlog.end_step(step, loss / env.world_size, grad_norm, lr)
        if stop:  # SIGTERM: saved
            break

    extra = {}
    if env.world_size > 1 and not stop and not args.simulate:  # after a SIGTERM, the time left is the scheduler's
        comm_pct, bus_gbps, comm_seconds = measure_communication(model, loss_fn, batches, args, env, scaler)
        nominal = nvlink_gbps(env.device)
        common.log(f"exposed communication {comm_pct:.1f}% of a step; all-reduce bus bandwidth {bus_gbps:.1f} GB/s "
                   f"(nominal NVLink per direction: {'unknown' if nominal is None else f'{nominal} GB/s'})")
        # Only a step's last micro-step all-reduces: its exposed seconds are the step's.
        extra = {"comm_pct": comm_pct, "allreduce_busbw_gbps": bus_gbps, "nvlink_nominal_gbps": nominal, "comm_seconds": comm_seconds}
    tlog.finish(**extra)


if __name__ == "__main__":
    common.run(main)
