"""--simulate N --simulate-rank R: run as rank R of an N-rank job on this one device.

The process group is fake (torch's fake_pg): every collective and transfer returns at
once having moved nothing, and is counted like a real one (options/count_comm.py); all the
rest, this rank's share of the work, is real: its compute, its memory, its shards and
stages. run_all.sh --simulate turns such ranks into predicted rows (sweep_report.py).

common.init_distributed calls init_process_group(); ddp_train.py and hybrid_train.py
take allreduce_hook(), the pipelines stage_shapes(). --count-comm comes with it.
"""

import inspect
import os

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

import common


def check_args(args, cfg):
    common.check(args.simulate_rank < args.simulate, f"--simulate-rank {args.simulate_rank} must be below --simulate {args.simulate}")
    common.check(int(os.environ.get("WORLD_SIZE", "1")) == 1,
                 "--simulate plays every rank's part in one process: launch it with python, not torchrun on several")
    common.check(not args.checkpoint_dir, "--simulate cannot checkpoint: the other ranks' parts exist nowhere")


def init_process_group(args, device):
    """Join a fake world of args.simulate ranks as args.simulate_rank."""
    dist.init_process_group("fake", store=FakeStore(), rank=args.simulate_rank, world_size=args.simulate)
    _receives_deliver_ones()
    common.log(f"simulated: rank {args.simulate_rank} of {args.simulate} on one {device.type}; its compute and memory are real, its "
               "communication counted, not sent. Losses from data no peer sent mean nothing, so the NaN stop is off.")


def _receives_deliver_ones():
    """A fake receive leaves its buffer as it was. A pipeline's first step passes a vote
    between its stages by dist.recv (1: every stage was given its shapes, none need be
    exchanged; torch 2.13), and a 0 read there would start an exchange of shapes no
    peer answers. So here a receive delivers ones, as a peer voting 1 would: patched at
    the Python call, not with a dispatch mode, which would keep the first step's blocks
    from ever being compiled."""
    recv = dist.recv

    def recv_ones(tensor, *args, **kwargs):
        source = recv(tensor, *args, **kwargs)
        tensor.fill_(1)
        return source

    dist.recv = recv_ones


def allreduce_hook(dtype):
    """DDP's communication hook on a fake process group, which hands DDP no future to wait
    on: each bucket is all-reduced at once (counted, in the dtype the chosen --comm-hook
    would send) and handed back done."""

    def hook(group, bucket):  # registered with DDP's process group as its state
        dist.all_reduce(bucket.buffer().to(dtype), group=group)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    return hook


def stage_shapes(args, cfg, stage, n_stages, micro_batch, device, activation_dtype=torch.float32):
    """What a pipeline stage receives and sends, given up front: a real pipeline learns it
    from a first exchange that a fake process group never delivers. Tokens into the first
    stage, the residual stream between stages, logits out of the last (their matmul's
    dtype under autocast)."""
    from torch.distributed.pipelining import PipelineStage

    stream = torch.zeros(micro_batch, args.seq_len, cfg.d_model, dtype=activation_dtype, device=device)
    first, last = stage == 0, stage == n_stages - 1
    logits_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # A received stream requires grad, as the real first exchange makes it: zero-bubble's
    # split backward computes a stage's weight gradients only through such an input.
    shapes = {"input_args": torch.zeros(micro_batch, args.seq_len, dtype=torch.long, device=device) if first
              else torch.zeros_like(stream, requires_grad=True),
              "output_args": torch.zeros(micro_batch, args.seq_len, cfg.vocab_size, dtype=logits_dtype, device=device) if last else stream,
              # Newer torch also wants the gradients' shapes up front (the same as the stream's).
              "input_grads": None if first else stream, "output_grads": None if last else stream}
    accepted = inspect.signature(PipelineStage.__init__).parameters
    return {k: v for k, v in shapes.items() if k in accepted}
