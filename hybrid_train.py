"""Hybrid parallelism: a pipeline across one dimension of a DeviceMesh, data parallel
across the other.

The world is laid out as a 2-D mesh, pp x dp. Along `pp` the model is cut into pipeline
stages exactly as in pipeline_train.py; along `dp` every stage is replicated, each
replica training on its own slice of the global batch. With FSDP2 (the default) the
replicas of a stage shard its parameters, gradients and optimizer state between them;
with DDP each keeps a full copy and all-reduces gradients. This is the article's hybrid
(its sketch: split the model, then DDP(model, process_group=...)), built on one mesh.

By default the data-parallel dimension is the inner one: its ranks are consecutive, so
they share a node and their all-gathers and reduce-scatters (the whole stage's
parameters and gradients, every step) run over NVLink, while the pipeline's sends (one
activation per micro-batch) cross nodes. --mesh-order dp-pp reverses that.

It builds on pipeline_train.py (its stages, schedules and report): copy both.

Launch:
    torchrun --standalone --nproc_per_node=8 hybrid_train.py --model 2.5b --pp 2 --global-batch-size 32
    # two nodes of 8: a 2-stage pipeline across the nodes, 8-way data parallel inside each
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \\
        --rdzv_id=job1 hybrid_train.py --model 2.5b --pp 2 --global-batch-size 64 --micro-batches 8
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import pipeline_train as pipeline  # the stages, schedules and their report: hybrid is a pipeline, replicated


def replicate(modules, args, dp_mesh, device):
    """Make each stage module data parallel over the dp dimension of the mesh."""
    if args.dp_wrapper == "ddp":
        # find_unused_parameters=True: the reducer then re-detects each micro-batch's
        # parameters instead of rebuilding its bucket order from all of them at once
        # (which fails at step 2), and static_graph=True would not synchronise at all.
        replicas = [DDP(m, process_group=dp_mesh.get_group(), find_unused_parameters=True,
                        device_ids=[device.index] if device.type == "cuda" else None) for m in modules]
        for replica in replicas if args.simulate else []:
            replica.register_comm_hook(dp_mesh.get_group(), common.option("simulate").allreduce_hook(torch.float32))
        return replicas
    # bf16 compute with fp32 gradient reduction; parameters stay gathered between a step's
    # micro-batches (reshard_after_forward=False), or every micro-batch would gather them.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else MixedPrecisionPolicy()
    for m in modules:
        for block in m.blocks.values():
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(m, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return modules


def replica_drift(modules, dp_mesh):
    """Largest difference between this stage's parameters and its dp rank 0 replica's:
    0 when DDP keeps the replicas in step (FSDP holds shards, not replicas)."""
    drift = torch.zeros((), device=next(modules[0].parameters()).device)
    for p in (p for m in modules for p in m.parameters()):
        reference = p.detach().clone()
        dist.broadcast(reference, group=dp_mesh.get_group(), group_src=0)
        drift = torch.maximum(drift, (p.detach() - reference).abs().max())
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    return drift.item()


def main():
    parser = common.base_parser(__doc__)
    parser.add_argument("--pp", type=common.positive, default=2, help="pipeline stages' ranks; data-parallel degree = world / pp (default: 2)")
    parser.add_argument("--dp-wrapper", choices=["fsdp", "ddp"], default="fsdp", help="how a stage's replicas stay in step (default: fsdp)")
    parser.add_argument("--mesh-order", choices=["pp-dp", "dp-pp"], default="pp-dp", help="outer-inner mesh dimensions; the inner one's ranks share a node (default: pp-dp)")
    pipeline.add_pipeline_args(parser)  # --schedule, --micro-batches, --stages-per-rank, --split
    args, cfg = common.parse_args(parser)
    env = common.init_distributed(args)
    common.check(env.world_size % args.pp == 0, f"world size {env.world_size} is not divisible by --pp {args.pp}")
    pp, dp = args.pp, env.world_size // args.pp
    common.check(not (args.dp_wrapper == "ddp" and args.schedule in pipeline.ZERO_BUBBLE),
                 f"--schedule {args.schedule} writes weight gradients itself, so DDP's all-reduce hooks never fire and replicas drift apart: use --dp-wrapper fsdp")
    n_stages = pipeline.check_pipeline_args(args, pp)
    common.split_layers(cfg.n_layers, n_stages, args.split)
    batch_per_call = args.global_batch_size // (dp * args.grad_accum)
    common.check(args.global_batch_size % (dp * args.grad_accum) == 0 and batch_per_call % args.micro_batches == 0,
                 f"--global-batch-size {args.global_batch_size} must divide into dp {dp} x --grad-accum {args.grad_accum} x --micro-batches {args.micro_batches}")

    mesh = common.make_mesh(env, pp=pp, dp=dp) if args.mesh_order == "pp-dp" else common.make_mesh(env, dp=dp, pp=pp)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    common.log(f"mesh {args.mesh_order}: pp {pp} x dp {dp} ({args.dp_wrapper}); rank 0's pipeline peers: {mesh['pp'].mesh.tolist()}")

    # Pipeline along pp, exactly as pipeline_train.py; then replicate each stage along dp.
    stage_ids = pipeline.stages_of_rank(args.schedule, pp_rank, pp, args.stages_per_rank)
    modules = [pipeline.build_stage_module(cfg, args, s, n_stages, env.device, fsdp=args.dp_wrapper == "fsdp") for s in stage_ids]
    wrapped = replicate(modules, args, mesh["dp"], env.device)
    # FSDP's bf16 policy casts each unit's input, so the residual stream crosses stages in bf16.
    stream = torch.bfloat16 if args.dp_wrapper == "fsdp" and args.dtype == "bf16" else torch.float32
    shapes = [common.option("simulate").stage_shapes(args, cfg, s, n_stages, batch_per_call // args.micro_batches, env.device, stream)
              if args.simulate else {} for s in stage_ids]
    stages = [PipelineStage(w, s, n_stages, env.device, group=mesh["pp"].get_group(), **shape) for w, s, shape in zip(wrapped, stage_ids, shapes)]
    micro_batches_per_step = args.micro_batches * args.grad_accum
    loss_fn = common.make_loss_fn(args)
    schedule = pipeline.make_schedule(args, stages, args.micro_batches, lambda out, y: loss_fn(out, y) / micro_batches_per_step)
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
    # FSDP's mixed-precision policy already computes in bf16; DDP needs autocast for it.
    autocast = common.autocast(args, env.device) if args.dp_wrapper == "ddp" else nullcontext()

    merged = pipeline.merged_stages(modules)
    optimizer = common.make_optimizer(merged, args)
    ckpt = common.checkpointer(args, cfg, merged, optimizer)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return
    batches = common.make_batches(args, cfg, env.device, batch_per_call, dp_rank, dp, start_step) if has_first or has_last else None
    tlog = common.TrainLog(args, env, cfg, "hybrid", optimizer, start_step, hooks=[ckpt])
    pipeline.time_stages(stages, tlog.clock)
    batches = tlog.timed_batches(batches)
    for step in tlog.steps():
        lr = common.set_lr(optimizer, step, args)
        losses = []
        for _ in range(args.grad_accum):
            x, y = next(batches) if batches else (None, None)
            inputs = (x,) if has_first else ()
            step_losses = []  # step() empties the list it is given before filling it
            targets = {"target": y, "losses": step_losses} if has_last else {}
            with autocast:
                schedule.step(*inputs, **targets)
            losses += step_losses
        # The norm over every stage (pp) of the whole model (FSDP shards reduce over dp).
        grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip, group=mesh["pp"].get_group())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Each replica's last stage holds its slice's mean loss: dp shares make the global mean.
        loss = torch.stack(losses).sum() / dp if has_last else torch.zeros((), device=env.device)
        if tlog.end_step(step, loss, grad_norm, lr):  # SIGTERM: saved, stop
            break

    report = pipeline.pipeline_report(tlog, args, schedule, modules, pp, env.device)
    drift = replica_drift(modules, mesh["dp"]) if args.dp_wrapper == "ddp" else None
    if drift is not None:
        common.log(f"largest difference between a stage's DDP replicas: {drift:.1e}")
    # Which ranks really are this rank's peers in each group: the mesh order's effect.
    groups = {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in ("pp", "dp")}
    tlog.finish(mesh={"pp": pp, "dp": dp}, mesh_order=args.mesh_order, dp_wrapper=args.dp_wrapper, group_ranks=groups,
                dp_replica_max_diff=drift, **report)


if __name__ == "__main__":
    common.run(main)
