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
The helpers above main() (schedules, stages, their timing and report) serve
hybrid_train.py too, which imports them.

Launch:
    torchrun --standalone --nproc_per_node=4 pipeline_train.py --model 2.5b --schedule 1f1b --micro-batches 8
    torchrun --standalone --nproc_per_node=4 pipeline_train.py --schedule interleaved-1f1b --stages-per-rank 2
    # two nodes: 16 stages of 2 blocks, on each node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \\
        --rdzv_id=job1 pipeline_train.py --model 2.5b --micro-batches 32 --global-batch-size 64
"""

import torch
import torch.distributed as dist
import torch.nn as nn

import common


def torch_version():
    return tuple(int(part) for part in torch.__version__.split(".")[:2])


# --schedule name -> class in torch.distributed.pipelining.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",  # all forwards, then all backwards
    "1f1b": "Schedule1F1B",  # one forward, one backward: fewer activations alive
    "interleaved-1f1b": "ScheduleInterleaved1F1B",  # several stages per rank: smaller bubble
    "zero-bubble": "ScheduleInterleavedZeroBubble",  # backward split into input and weight grads
    "zbv": "ScheduleZBVZeroBubble",  # zero bubble, two stages per rank in a V
}
ZERO_BUBBLE = {"zero-bubble", "zbv"}


def add_pipeline_args(parser):
    """The pipeline's flags, the same in pipeline_train.py and hybrid_train.py."""
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default: 1f1b)")
    parser.add_argument("--micro-batches", type=common.positive, default=4,
                        help="micro-batches each pipeline's share of a step is cut into: the article's `chunks` (default: 4)")
    parser.add_argument("--stages-per-rank", type=common.positive,
                        help="stages each rank holds; interleaved and zero-bubble schedules need 2 or more (default: 1, or 2 for those)")
    parser.add_argument("--split", type=common.block_counts, help="blocks per stage, comma-separated, e.g. 3,5 (default: even)")


def stages_of_rank(schedule, pp_rank, pp_size, stages_per_rank):
    """Global indices of the stages a rank holds: loop schedules put stage s on rank
    s % pp; the V schedule puts stages r and 2·pp-1-r on rank r, so the last stage sits
    beside the first and the loss's gradient turns around without a transfer."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def check_pipeline_args(args, pp_size):
    """Stages per rank and schedule must fit each other; returns the number of stages."""
    multi = args.schedule in ("interleaved-1f1b", "zero-bubble", "zbv")
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if multi else 1
    common.check(multi or args.stages_per_rank == 1, f"--schedule {args.schedule} runs one stage per rank; use interleaved-1f1b or zero-bubble for --stages-per-rank {args.stages_per_rank}")
    common.check(args.schedule != "zbv" or args.stages_per_rank == 2, "--schedule zbv places exactly 2 stages per rank")
    # Seen with gloo: torch 2.11 fails ("Pair is not connected") where the V hands
    # activations between a rank's own two stages; 2.13 runs it.
    common.check(not (args.schedule == "zbv" and dist.get_backend() == "gloo" and torch_version() < (2, 13)),
                 f"--schedule zbv on gloo needs torch 2.13 or newer (this is {torch.__version__}): use NCCL or another schedule")
    common.check(not multi or args.stages_per_rank >= 2, f"--schedule {args.schedule} needs --stages-per-rank of at least 2")
    common.check(not (args.compile and args.schedule in ZERO_BUBBLE), f"--schedule {args.schedule} splits backward by hand, which compiled blocks do not support: drop --compile")
    common.refuse_fp16(args, "the loss scaler's inf check would have to agree across pipeline stages")
    return pp_size * args.stages_per_rank


def build_stage_module(cfg, args, stage, n_stages, device, fsdp=False):
    """The blocks of one pipeline stage; the first stage also embeds, the last also holds
    the final norm and head. Weights equal the whole model's at the same place."""
    layers = common.split_layers(cfg.n_layers, n_stages, args.split)[stage]
    return common.build_model(cfg, device, args, layers, embed=stage == 0, head=stage == n_stages - 1, fsdp=fsdp)


def make_schedule(args, stages, n_microbatches, loss):
    """Build the schedule once; its own rules on micro-batches come back as one line.
    scale_grads=False: `loss` must already be normalised by the global batch, since the
    schedule's own division by n_microbatches would run again at every grad-accum step."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[args.schedule])
    try:
        if len(stages) == 1 and args.schedule in ("gpipe", "1f1b"):
            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise common.ConfigError(f"--schedule {args.schedule} cannot run {n_microbatches} micro-batches over {stages[0].num_stages} stages: {e}") from None


def merged_stages(modules):
    """This rank's stage modules under the whole model's parameter names (blocks keep
    their global index), for checkpoints: stages on different ranks never share a name."""
    merged = nn.Module()
    merged.blocks = nn.ModuleDict({i: b for m in modules for i, b in m.blocks.items()})
    for m in modules:
        for name in ("tok_emb", "pos_emb", "norm", "head"):
            if getattr(m, name) is not None:
                setattr(merged, name, getattr(m, name))
    return merged


def theoretical_bubble_pct(schedule, pp_size, n_microbatches, stages_per_rank):
    """Idle share of an ideal pipeline with equal stages and free transfers: (p-1)/(m+p-1)
    for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved over v stages per rank. None for the
    zero-bubble schedules, whose bubble depends on how weight gradients fill it."""
    if schedule in ZERO_BUBBLE:
        return None
    return 100 * (pp_size - 1) / (stages_per_rank * n_microbatches + pp_size - 1)


def pipeline_report(tlog, args, schedule, modules, pp_size, device):
    """Measured busy % per rank and bubble beside the schedule's theory: the results
    fields pipeline_train.py and hybrid_train.py both report (a collective)."""
    busy = common.gather_floats(tlog.clock.busy_pct(tlog.timed), device)
    blocks = [int(b) for b in common.gather_floats(sum(len(m.blocks) for m in modules), device)]
    utilisation = sum(busy) / len(busy)
    theory = theoretical_bubble_pct(args.schedule, pp_size, args.micro_batches, args.stages_per_rank)
    common.log(f"busy % per rank {busy}; bubble {100 - utilisation:.1f}% measured, {'n/a' if theory is None else f'{theory:.1f}%'} "
               f"in theory for {args.schedule} with {pp_size} ranks x {args.stages_per_rank} stages and {args.micro_batches} micro-batches")
    return {"schedule": args.schedule, "micro_batches": args.micro_batches, "stages_per_rank": args.stages_per_rank,
            "schedule_class": type(schedule).__name__, "actions_last_step": tlog.clock.last_actions, "blocks_per_rank": blocks,
            "action_seconds": tlog.clock.mean_seconds(tlog.timed), "pipeline_order": pipeline_order(schedule, args, pp_size),
            "busy_pct_per_rank": busy, "utilisation_pct": utilisation, "bubble_pct": 100 - utilisation, "bubble_pct_theory": theory}


def pipeline_order(schedule, args, pp_size):
    """Every pipeline rank's compute actions in the order its schedule runs them, as
    "F1:0": from the schedule itself for the multi-stage schedules (their runtime executes
    that table), from GPipe's and 1F1B's definitions for the single-stage ones (newer
    torch tabulates those too, but the table is not what runs: it is off by one on the
    last stage in 2.13)."""
    if args.schedule not in ("gpipe", "1f1b"):
        order = schedule.pipeline_order
        return {rank: [f"{a.computation_type.value}{a.stage_index}:{a.microbatch_index}" for a in actions
                       if a is not None and a.computation_type.value in ("F", "B", "I", "W")] for rank, actions in order.items()}
    m, orders = args.micro_batches, {}
    for rank in range(pp_size):
        warmup = m if args.schedule == "gpipe" else min(m, pp_size - rank)  # 1F1B: a forward for every stage ahead
        order = [f"F{rank}:{i}" for i in range(warmup)]
        for i in range(m):  # then one backward, one forward
            order += [f"B{rank}:{i}"] + ([f"F{rank}:{warmup + i}"] if warmup + i < m else [])
        orders[rank] = order
    return orders


def time_stages(stages, clock):
    """Each stage's forward, backward and weight-gradient work timed by the step clock, as
    "F1:0" (stage 1's forward of micro-batch 0; B a whole backward, I its input-gradient
    half, W its weight-gradient half): a step's order of them is what run_all.sh --simulate
    replays, and their times are the rank's busy share."""
    for stage in stages:
        for name, letter in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            def label(chunk, *args, letter=letter, stage_index=stage.stage_index, **kwargs):
                kind = "I" if letter == "B" and not kwargs.get("full_backward", True) else letter
                return f"{kind}{stage_index}:{chunk}"

            setattr(stage, name, clock.timed(getattr(stage, name), label))


def main():
    parser = common.base_parser(__doc__)
    add_pipeline_args(parser)
    args, cfg = common.parse_args(parser)
    env = common.init_distributed(args)
    n_stages = check_pipeline_args(args, env.world_size)
    common.split_layers(cfg.n_layers, n_stages, args.split)  # refuses a split that cannot be
    batch_per_call = args.global_batch_size // args.grad_accum
    common.check(args.global_batch_size % args.grad_accum == 0 and batch_per_call % args.micro_batches == 0,
                 f"--global-batch-size {args.global_batch_size} must divide into --grad-accum {args.grad_accum} x --micro-batches {args.micro_batches}")

    # This rank's stages: only their blocks are ever built here.
    stage_ids = stages_of_rank(args.schedule, env.rank, env.world_size, args.stages_per_rank)
    modules = [build_stage_module(cfg, args, s, n_stages, env.device) for s in stage_ids]
    micro_batch = batch_per_call // args.micro_batches
    # A simulated rank is given what it receives and sends: no peer would answer the exchange.
    shapes = [common.option("simulate").stage_shapes(args, cfg, s, n_stages, micro_batch, env.device) if args.simulate else {} for s in stage_ids]
    # Imported here, not at the top: sweep_report.py imports this file for its schedule
    # arithmetic and would pay a second and a half for torch's pipelining package.
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(m, s, n_stages, env.device, **shape) for m, s, shape in zip(modules, stage_ids, shapes)]
    # Each micro-batch's loss is divided by every micro-batch of the step, so the summed
    # gradients are the global-batch mean (the schedule itself must not divide again).
    micro_batches_per_step = args.micro_batches * args.grad_accum
    loss_fn = common.make_loss_fn(args)
    schedule = make_schedule(args, stages, args.micro_batches, lambda out, y: loss_fn(out, y) / micro_batches_per_step)
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids

    merged = merged_stages(modules)
    optimizer = common.make_optimizer(merged, args)
    ckpt = common.checkpointer(args, cfg, merged, optimizer)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return
    # Only the first stage needs inputs and only the last needs targets.
    batches = common.make_batches(args, cfg, env.device, batch_per_call, start_step=start_step) if has_first or has_last else None
    tlog = common.TrainLog(args, env, cfg, "pipeline", optimizer, start_step, hooks=[ckpt])
    time_stages(stages, tlog.clock)
    batches = tlog.timed_batches(batches)
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
        if tlog.end_step(step, loss, grad_norm, lr):  # SIGTERM: saved, stop
            break

    tlog.finish(**pipeline_report(tlog, args, schedule, modules, env.world_size, env.device))


if __name__ == "__main__":
    common.run(main)
