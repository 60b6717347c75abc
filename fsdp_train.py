"""Fully sharded data parallel (ZeRO-3) with FSDP2's fully_shard.

As in DDP, every rank trains on its own slice of each global batch; unlike DDP, a rank
holds only 1/N of every parameter, gradient and optimizer state, so the memory for
training state falls as ranks are added. Each Transformer block is one FSDP unit: its
parameters are all-gathered just before it runs and freed just after (ZeRO-3), gathered
again in backward, and its gradients are reduce-scattered so each rank keeps only the
shard its optimizer steps. The root unit holds embeddings, final norm and head.

--no-reshard-after-forward keeps each block's gathered parameters from forward to
backward (ZeRO-2-like): one all-gather per block instead of two, for the memory of the
gathered parameters. --cpu-offload keeps shards, gradients and the optimizer step on the
CPU: a GPU then holds only the blocks in flight and the activations, so one GPU trains
what plain DDP cannot hold (--model 6.7b: 107 GB of fp32 weights, gradients and Adam
moments; on one H200 DDP runs out of memory at batch 16, offload trains it in 74 GiB).

Communication: per micro-step a rank sends (N-1)/N of the parameters twice (all-gathers)
and of the gradients once (reduce-scatter), 1.5x DDP's all-reduce at the same dtype, or
1x without resharding. gloo (CPU) has no real reduce-scatter: it all-reduces the whole
buffer, so CPU timings and profiles overstate FSDP's communication.

Launch:
    python fsdp_train.py --model 6.7b --cpu-offload --global-batch-size 16   # one GPU
    torchrun --standalone --nproc_per_node=8 fsdp_train.py --model 6.7b --global-batch-size 64
    # two nodes of 8 GPUs: run on each node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=$HEAD_NODE:29500 --rdzv_id=job1 fsdp_train.py --model 6.7b --global-batch-size 128
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import common


def local_bytes(tensors):
    """Bytes this rank's storage really holds for these tensors: a DTensor counts only its
    local shard (FSDP's padding included), a wrapper (float8's weights) what it wraps, and
    views of one storage count once."""
    storages = {}

    def add(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        else:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for t in tensors:
        add(t)
    return sum(storages.values())


def main():
    parser = common.base_parser(__doc__)
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="free each block's gathered parameters after its forward and gather them again in backward "
                             "(ZeRO-3, the default); --no-reshard-after-forward keeps them until backward (ZeRO-2-like)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep parameter, gradient and optimizer-state shards on the CPU and step the optimizer there")
    args, cfg = common.parse_args(parser)
    # Offloaded gradients stay on the CPU, where clipping reduces their norm: that needs
    # gloo beside NCCL.
    env = common.init_distributed(args, cpu_collectives=args.cpu_offload)
    common.check(args.global_batch_size % (env.world_size * args.grad_accum) == 0,
                 f"--global-batch-size {args.global_batch_size} must divide evenly over {env.world_size} ranks x --grad-accum {args.grad_accum}")
    common.refuse_fp16(args, "each rank's GradScaler would see only its own gradient shards, so ranks could disagree on skipping a step")
    if dist.get_backend() == "gloo" and env.world_size > 1:
        common.log("note: gloo has no reduce-scatter (it all-reduces the whole buffer): CPU timings and profiles overstate FSDP's communication")

    # Every rank builds the same full model, then keeps only its shards: the weights equal
    # the single-process run's.
    model = common.build_model(cfg, env.device, args, fsdp=True)
    loss_fn = common.make_loss_fn(args)
    mesh = common.make_mesh(env, dp=env.world_size)
    # bf16: FSDP casts the gathered parameters and each unit's input to bf16, so every
    # matmul runs in bf16 without autocast (the residual stream too, unlike autocast);
    # norms and softmax accumulate in fp32 inside their kernels, the loss is computed in
    # fp32, and gradients are reduced and stepped in fp32.
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if args.cpu_offload else OffloadPolicy()
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard_after_forward, mp_policy=precision, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=offload)  # by default the root keeps its parameters for backward, which starts with it
    if env.device.type == "cuda":
        # The whole fp32 model sat on each GPU only while it was built: count training's peak.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)

    optimizer = common.make_optimizer(model, args)
    ckpt = common.checkpointer(args, cfg, model, optimizer)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return

    micro_batch = args.global_batch_size // (env.world_size * args.grad_accum)
    batches = common.make_batches(args, cfg, env.device, micro_batch, env.rank, env.world_size, start_step)
    tlog = common.TrainLog(args, env, cfg, "fsdp", optimizer, start_step, hooks=[ckpt])
    batches = tlog.timed_batches(batches)
    grad_bytes = 0
    for step in tlog.steps():
        lr = common.set_lr(optimizer, step, args)
        loss = torch.zeros((), device=env.device)
        for _ in range(args.grad_accum):
            x, y = next(batches)
            # Every micro-step reduce-scatters: skipping it (set_requires_gradient_sync) would
            # keep the whole unsharded gradient on every rank, the memory FSDP is here to save.
            micro_loss = loss_fn(model(x), y) / args.grad_accum
            micro_loss.backward()
            loss += micro_loss.detach()
        grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip)
        optimizer.step()
        grad_bytes = local_bytes(p.grad for p in model.parameters())
        optimizer.zero_grad(set_to_none=True)
        # This rank's loss is the mean over its G/world samples; the shares sum to the global mean.
        if tlog.end_step(step, loss / env.world_size, grad_norm, lr):  # SIGTERM: saved, stop
            break

    # What sharding buys: the training state a rank holds (the largest rank's), and each
    # rank's peak (on a CPU, resident memory is mostly torch itself: the shards are the figure).
    optim_state = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    held = torch.tensor([local_bytes(model.parameters()), grad_bytes, local_bytes(optim_state)], dtype=torch.float64, device=env.device)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    param_bytes, grad_bytes, optim_bytes = (int(b) for b in held.tolist())
    peak_per_rank = common.gather_floats(tlog.peak_mem[0], env.device)
    common.log(f"per rank: parameter shards {param_bytes / 2**20:.1f} MiB, gradient shards {grad_bytes / 2**20:.1f} MiB, "
               f"optimizer state {optim_bytes / 2**20:.1f} MiB, on {'cpu (offloaded)' if args.cpu_offload else env.device.type} "
               f"(unsharded fp32 parameters: {common.count_params(cfg) * 4 / 2**20:.1f} MiB); peak GiB per rank {peak_per_rank}")
    # Whether FSDP itself keeps them on the CPU (its state, not the flag): on a CPU-only
    # machine that is the only place the difference shows.
    offloaded = sum(p.offload_to_cpu for block in model.blocks.values() for p in block._get_fsdp_state()._fsdp_param_group.fsdp_params)
    tlog.finish(param_shard_bytes=param_bytes, grad_shard_bytes=grad_bytes, optim_shard_bytes=optim_bytes,
                reshard_after_forward=args.reshard_after_forward, cpu_offload=args.cpu_offload,
                params_offloaded_to_cpu=offloaded)


if __name__ == "__main__":
    common.run(main)
