"""Naive model parallelism: the model split layer-wise over ranks, one batch at a time.

Rank r holds a consecutive slice of the blocks (the first rank also the embeddings, the
last also the final norm, head and loss). The whole batch flows forward through the ranks
one after another, activations passed on with point-to-point sends, and the activation
gradients flow back the same way. There are no micro-batches, so while one rank computes
every other rank waits: this lets a model too large for one GPU train, but it can never
beat one GPU that holds the whole model. pipeline_train.py is the same split, pipelined.

The article's version: Linear+ReLU on cuda:0, Linear+ReLU on cuda:1, x.to("cuda:1") in
between, in one process. Here each part is its own process, as on several nodes.

Launch:
    torchrun --standalone --nproc_per_node=4 model_parallel_train.py --model 2.5b
    torchrun --standalone --nproc_per_node=2 model_parallel_train.py --split 2,6   # a bad split
"""

import time

import torch
import torch.distributed as dist

import common


def measure_transfer_seconds(env, shape, repeats=3):
    """Time one activation's trip across each boundary r -> r+1 alone, by ping-pong with
    nobody else working. Returns (seconds to the previous rank, to the next), 0 at the ends."""
    buffer = torch.zeros(shape, device=env.device)
    seconds = []
    for boundary in range(env.world_size - 1):
        dist.barrier()
        if env.rank in (boundary, boundary + 1):
            peer = boundary + 1 if env.rank == boundary else boundary
            common.synchronize(env.device)
            start = time.perf_counter()
            for _ in range(repeats):
                if env.rank == boundary:
                    dist.send(buffer, peer)
                    dist.recv(buffer, peer)
                else:
                    dist.recv(buffer, peer)
                    dist.send(buffer, peer)
            common.synchronize(env.device)
            seconds.append((time.perf_counter() - start) / (2 * repeats))
        else:
            seconds.append(0.0)
    previous = seconds[env.rank - 1] if env.rank > 0 else 0.0
    following = seconds[env.rank] if env.rank < env.world_size - 1 else 0.0
    return previous, following


def main():
    parser = common.base_parser(__doc__)
    parser.add_argument("--split", type=common.block_counts, help="blocks per rank, comma-separated, e.g. 2,6 (default: even)")
    args, cfg = common.parse_args(parser)
    env = common.init_distributed(args)
    common.refuse_fp16(args, "the loss scaler's inf check would have to agree across the model's parts")
    common.check(args.global_batch_size % args.grad_accum == 0, f"--global-batch-size {args.global_batch_size} must divide by --grad-accum {args.grad_accum}")
    split = common.split_layers(cfg.n_layers, env.world_size, args.split)
    layers = split[env.rank]
    first, last = env.rank == 0, env.rank == env.world_size - 1

    model = common.build_model(cfg, env.device, args, layers, embed=first, head=last)
    loss_fn = common.make_loss_fn(args)
    optimizer = common.make_optimizer(model, args)
    ckpt = common.checkpointer(args, cfg, model, optimizer)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return

    micro_batch = args.global_batch_size // args.grad_accum
    batches = common.make_batches(args, cfg, env.device, micro_batch, start_step=start_step) if first or last else None
    # What crosses a boundary: the residual stream, fp32 even under autocast.
    activation_shape = (micro_batch, args.seq_len, cfg.d_model)
    tlog = common.TrainLog(args, env, cfg, "model_parallel", optimizer, start_step, hooks=[ckpt])
    # Compute timed apart from the waits around it: the rank's busy share, measured.
    forward, backward = tlog.clock.timed(model, "F"), tlog.clock.timed(torch.autograd.backward, "B")
    batches = tlog.timed_batches(batches)
    common.log(f"blocks per rank: {[len(r) for r in split]}")
    for step in tlog.steps():
        lr = common.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=env.device)
        for _ in range(args.grad_accum):
            x, y = next(batches) if batches else (None, None)
            # Forward: wait for the previous rank's activations, run my blocks, pass them on.
            if first:
                inputs = x
            else:
                inputs = torch.empty(activation_shape, device=env.device)
                dist.recv(inputs, env.rank - 1)
                inputs.requires_grad_()
            with common.autocast(args, env.device):
                out = forward(inputs)
                if last:
                    loss = loss_fn(out, y) / args.grad_accum
            # Backward: from the loss, or from the gradient the next rank sends back.
            if last:
                backward(loss)
                loss_sum += loss.detach()
            else:
                dist.send(out.detach(), env.rank + 1)
                grad = torch.empty_like(out)
                dist.recv(grad, env.rank + 1)
                backward(out, grad)
            if not first:
                dist.send(inputs.grad, env.rank - 1)
        grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip, group=dist.group.WORLD)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if tlog.end_step(step, loss_sum, grad_norm, lr):  # only the last rank's loss is non-zero; SIGTERM: saved, stop
            break

    # Per rank: computing, moving activations (each crossing timed alone, times the
    # crossings a step makes), and waiting for the others (the rest of the step).
    _, step_seconds = tlog.throughput()
    to_previous, to_next = measure_transfer_seconds(env, activation_shape)
    busy_pct = tlog.clock.busy_pct(tlog.timed)
    transfer_pct = 100 * 2 * args.grad_accum * (to_previous + to_next) / step_seconds  # forward and backward
    busy = common.gather_floats(busy_pct, env.device)
    transfer = common.gather_floats(transfer_pct, env.device)
    idle = [round(max(0.0, 100 - b - t), 2) for b, t in zip(busy, transfer)]
    for rank, (b, t, i) in enumerate(zip(busy, transfer, idle)):
        common.log(f"rank {rank}: busy {b:5.1f}% | transfers {t:5.1f}% | idle {i:5.1f}%")
    tlog.finish(split=[len(r) for r in split],
                busy_pct_per_rank=busy, transfer_pct_per_rank=transfer, idle_pct_per_rank=idle,
                utilisation_pct=sum(busy) / len(busy), action_seconds=tlog.clock.mean_seconds(tlog.timed))


if __name__ == "__main__":
    common.run(main)
