"""Megatron-style tensor parallelism with DTensor, optionally composed with FSDP (2-D).

Tensor parallelism splits every weight matrix over the tp ranks of a group, which all
work on the same samples. In each block, the q, k, v projection is split by columns, so
each rank computes n_heads/tp whole heads; the output projection is split by rows, so
each rank holds a partial sum and one all-reduce completes the block's attention. The
MLP is the same pair: fc_in by columns (GELU needs no communication), fc_out by rows.
Per block that is two all-reduces in forward and two in backward, of activations, not
weights: cheap inside a node over NVLink, too chatty across nodes. The embeddings are
split by rows (vocabulary, positions) and the head by columns; the logits stay split
over the vocabulary, and loss_parallel computes the cross entropy from the shards.

--sequence-parallel also splits the sequence outside the matmuls: norms and residual
stream hold T/tp tokens per rank, and each all-reduce becomes a reduce-scatter plus an
all-gather, the same traffic for 1/tp of those activations. (On gloo, a reduce-scatter
is an all-reduce of the whole buffer, so CPU runs overstate its traffic.)

--dp N composes FSDP over a second mesh dimension: world = dp x tp, tp the inner
dimension (consecutive ranks, one node), FSDP across the tp groups: the common layout
for large models. The model code in common.py stays free of parallelism:
parallelize_module turns its weights into DTensors and hooks the collectives around them.

Launch:
    torchrun --standalone --nproc_per_node=4 tensor_parallel_train.py --model 2.5b --sequence-parallel
    torchrun --standalone --nproc_per_node=8 tensor_parallel_train.py --model 2.5b --dp 2  # 2 x tp 4
    # two nodes of 8 GPUs, tp 4 inside a node, FSDP over 4 groups: run on each node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \\
        --rdzv_id=job1 tensor_parallel_train.py --model 2.5b --dp 4 --sequence-parallel
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

import common


class ReplicatedNorm(ParallelStyle):
    """A norm without sequence parallelism runs whole on every tp rank; its weights still
    become (replicated) DTensors, because FSDP and clipping need every parameter on one mesh."""

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, input_fn=self._replicated_input)

    @staticmethod
    def _replicated_input(module, inputs, mesh):
        return DTensor.from_local(inputs[0], mesh, [Replicate()])


def norms_output_in(model, dtype):
    """Autocast runs LayerNorm in fp32 and casts its output for the next matmul only once
    inside it, after the tensor-parallel boundary: the gather of that output (with SP) and,
    in backward, the all-reduce or reduce-scatter of its gradient would move 4 bytes an
    element. Cast where the norm ends and they move 2, as the matmuls compute anyway.
    Without SP the gradient is a partial sum that DTensor reduces only where it must (the
    norm's input, past the cast's backward): leaving and re-entering DTensor right after the
    cast makes its backward reduce it there, in bf16."""
    def cast(module, inputs, output):
        output = output.to(dtype)
        return DTensor.from_local(output.to_local(), output.device_mesh, output.placements)

    for norm in [m for block in model.blocks.values() for m in (block.attn_norm, block.mlp_norm)] + [model.norm]:
        norm.register_forward_hook(cast)


def tensor_parallel(model, tp_mesh, sequence_parallel, float8):
    """Turn the model's weights into DTensors split over tp_mesh; the styles place the
    collectives between them."""
    # The residual stream between blocks: split along the sequence (dim 1), or whole on every rank.
    stream = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel if sequence_parallel else ReplicatedNorm
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8 == "tensorwise" and dist.get_backend() == "gloo":
        common.log("note: gloo cannot all-gather float8, so activations travel in their own dtype here (on NCCL in float8)")
    elif float8 == "tensorwise":
        # torchao's styles cast a block input to float8 before gathering it (with SP): the
        # all-gather then moves 1 byte per element.
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

        colwise, rowwise, prepare_input = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, {
            "attn_norm": norm(),
            # One gather of the stream (with SP) feeds q, k and v; in backward their input
            # gradient, a partial sum, is reduced here.
            "attn": prepare_input(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "attn.qkv": colwise(),  # its features grouped by head: each rank gets whole heads
            "attn.o": rowwise(output_layouts=stream),  # all-reduce, or reduce-scatter with SP
            "mlp_norm": norm(),
            "mlp": prepare_input(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.fc_in": colwise(),
            "mlp.fc_out": rowwise(output_layouts=stream),
        })
    parallelize_module(model, tp_mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        # pos_emb's output is (T, d): split on dim 0, it adds to tok_emb's (B, T/tp, d) shard.
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else Replicate()),
        "norm": norm(),
        # Logits stay split over the vocabulary: loss_parallel computes the loss from the shards.
        "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    })


def main():
    parser = common.base_parser(__doc__)
    parser.add_argument("--dp", type=common.positive, default=1, help="data-parallel (FSDP) groups; tp = world size / dp (default: 1, pure tensor parallelism)")
    parser.add_argument("--sequence-parallel", action="store_true", help="split norms and the residual stream along the sequence too")
    args, cfg = common.parse_args(parser)
    env = common.init_distributed(args)
    common.check(env.world_size % args.dp == 0, f"--dp {args.dp} must divide the world size {env.world_size}")
    tp = env.world_size // args.dp
    common.check(cfg.n_heads % tp == 0, f"{cfg.n_heads} heads cannot be split over tp {tp} (world {env.world_size} / --dp {args.dp}): tp must divide the head count")
    common.check(not args.sequence_parallel or args.seq_len % tp == 0, f"--sequence-parallel splits --seq-len {args.seq_len} over tp {tp}: it must divide evenly")
    common.check(args.global_batch_size % (args.dp * args.grad_accum) == 0,
                 f"--global-batch-size {args.global_batch_size} must divide evenly over --dp {args.dp} x --grad-accum {args.grad_accum}")
    common.refuse_fp16(args, "each rank's GradScaler would see only its own gradient shards, so ranks could disagree on skipping a step")

    mesh = common.make_mesh(env, dp=args.dp, tp=tp)
    common.log(f"mesh dp {args.dp} x tp {tp}; rank 0's tensor-parallel group: ranks {mesh['tp'].mesh.tolist()}")
    # Whole, then split: weights equal the single process's. Its blocks compile at their first
    # call, so after tensor_parallel() splits them: torchtitan's order, parallelize then compile.
    model = common.build_model(cfg, env.device, args, fsdp=args.dp > 1)
    # Eager even under --compile: loss_parallel bakes this rank's vocabulary offset into a
    # compiled loss, and torch's compile cache keys it without the rank (pytorch#188390),
    # so the next run would hand rank 0's loss to every rank: wrong losses, no error.
    loss_fn = common.loss_fn
    tensor_parallel(model, mesh["tp"], args.sequence_parallel, args.float8)
    # FSDP over dp, per block and at the root, with bf16 mixed precision as in fsdp_train.py
    # (weights and unit inputs cast to bf16, gradients reduced and stepped in fp32). At
    # --dp 1 it would have nothing to shard and only add its casts and copies to each step
    # (torchtitan also applies a parallelism only where its degree is above 1): autocast
    # gives the bf16 matmuls instead.
    if args.dp > 1:
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else MixedPrecisionPolicy()
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh["dp"], mp_policy=precision)
        fully_shard(model, mesh=mesh["dp"], mp_policy=precision)
    autocast = common.autocast(args, env.device) if args.dp == 1 else nullcontext()
    if args.dp == 1 and args.dtype == "bf16":
        norms_output_in(model, torch.bfloat16)

    optimizer = common.make_optimizer(model, args)
    ckpt = common.checkpointer(args, cfg, model, optimizer)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return

    # The tp ranks of one dp group must see the same samples: split the batch by dp rank.
    dp_rank = mesh["dp"].get_local_rank()
    micro_batch = args.global_batch_size // (args.dp * args.grad_accum)
    batches = common.make_batches(args, cfg, env.device, micro_batch, dp_rank, args.dp, start_step)
    tlog = common.TrainLog(args, env, cfg, "tp", optimizer, start_step, hooks=[ckpt])
    batches = tlog.timed_batches(batches)
    for step in tlog.steps():
        lr = common.set_lr(optimizer, step, args)
        loss = torch.zeros((), device=env.device)
        for _ in range(args.grad_accum):
            x, y = next(batches)
            with loss_parallel():  # cross entropy over vocabulary shards, forward and backward
                with autocast:
                    logits = model(x)
                micro_loss = loss_fn(logits, y) / args.grad_accum
                micro_loss.backward()
            loss += micro_loss.detach().to_local()  # a replicated DTensor: the same on every tp rank
        grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Every tp rank holds its dp group's mean loss: over all ranks, the shares
        # (loss / world) sum to the global mean.
        if tlog.end_step(step, loss / env.world_size, grad_norm, lr):  # SIGTERM: saved, stop
            break

    tlog.finish(mesh={"dp": args.dp, "tp": tp}, sequence_parallel=args.sequence_parallel)


if __name__ == "__main__":
    common.run(main)
