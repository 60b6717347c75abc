"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut into consecutive stages of blocks, one stage per rank (or, for the
interleaved and zero-bubble schedules, several per rank). Each step's batch is cut into
micro-batches that flow through the stages one after another, so that while stage 2
works on micro-batch 1, stage 1 already works on micro-batch 2. The schedule fixes the
order of forwards and backwards on every rank; the time a rank still waits is the bubble,
(p-1)/(m+p-1) of the step for GPipe and 1F1B with p stages and m micro-batches.

The article used torch.distributed.pipeline.sync.Pipe(model, chunks=4), which PyTorch has
since removed; its successor is torch.distributed.pipelining, and `chunks` is
--micro-batches here. Each rank builds only its own stages (no tracing of the whole model).

Launch:
    torchrun --standalone --nproc_per_node=4 pipeline_train.py --model 2.5b --schedule 1f1b --micro-batches 8
    torchrun --standalone --nproc_per_node=4 pipeline_train.py --schedule interleaved-1f1b --stages-per-rank 2
    # two nodes: 16 stages of 2 blocks, on each node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \\
        --rdzv_id=job1 pipeline_train.py --model 2.5b --micro-batches 32 --global-batch-size 64
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import common


def main():
    parser = common.base_parser(__doc__)
    common.add_pipeline_args(parser)  # --schedule, --micro-batches, --stages-per-rank, --split
    args, cfg = common.parse_args(parser)
    env = common.init_distributed(args)
    n_stages = common.check_pipeline_args(args, env.world_size)
    common.split_layers(cfg.n_layers, n_stages, args.split)  # refuses a split that cannot be
    batch_per_call = args.global_batch_size // args.grad_accum
    common.check(args.global_batch_size % args.grad_accum == 0 and batch_per_call % args.micro_batches == 0,
                 f"--global-batch-size {args.global_batch_size} must divide into --grad-accum {args.grad_accum} x --micro-batches {args.micro_batches}")

    # This rank's stages: only their blocks are ever built here.
    stage_ids = common.stages_of_rank(args.schedule, env.rank, env.world_size, args.stages_per_rank)
    modules = [common.build_stage_module(cfg, args, s, n_stages, env.device) for s in stage_ids]
    micro_batch = batch_per_call // args.micro_batches
    stages = [PipelineStage(m, s, n_stages, env.device, **common.stage_shapes(args, cfg, s, n_stages, micro_batch, env.device))
              for m, s in zip(modules, stage_ids)]
    # Each micro-batch's loss is divided by every micro-batch of the step, so the summed
    # gradients are the global-batch mean (the schedule itself must not divide again).
    micro_batches_per_step = args.micro_batches * args.grad_accum
    loss_fn = common.make_loss_fn(args)
    schedule = common.make_schedule(args, stages, args.micro_batches, lambda out, y: loss_fn(out, y) / micro_batches_per_step)
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids

    optimizer = common.make_optimizer((p for m in modules for p in m.parameters()), args)
    ckpt = common.Checkpointer(args, cfg, common.merged_stages(modules), optimizer)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return
    # Only the first stage needs inputs and only the last needs targets.
    batches = common.make_batches(args, cfg, env.device, batch_per_call, start_step=start_step) if has_first or has_last else None
    timer = common.ComputeTimer(env.device, optimizer, stages)
    tlog = common.TrainLog(args, env, cfg, "pipeline", ckpt, optimizer)
    batches = tlog.timed_batches(batches)
    with common.Profiler(args, env) as prof:
        for step in tlog.steps():
            lr = common.set_lr(optimizer, step, args)
            losses = []  # one per micro-batch, on the rank holding the last stage
            for _ in range(args.grad_accum):
                x, y = next(batches) if batches else (None, None)
                inputs = (x,) if has_first else ()
                step_losses = []  # step() empties the list it is given before filling it
                targets = {"target": y, "losses": step_losses} if has_last else {}
                with common.autocast(args, env.device):
                    schedule.step(*inputs, **targets)
                losses += step_losses
            # Clip by the norm over all stages, not each stage's own.
            grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip, group=dist.group.WORLD)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The loss lives on the last stage; the all-reduce in end_step brings it to rank 0.
            loss = torch.stack(losses).sum() if has_last else torch.zeros((), device=env.device)
            stop = tlog.end_step(step, loss, grad_norm, lr)
            timer.end_step(tlog.step_times[-1])
            ckpt.maybe_save(step + 1, force=stop)
            prof.step()
            if stop:
                break

    tlog.finish(**common.pipeline_report(timer, tlog, args, schedule, modules, env.world_size, env.device))


if __name__ == "__main__":
    common.run(main)
