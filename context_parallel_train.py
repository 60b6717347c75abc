"""Context parallelism: one sequence split across ranks, for sequences one GPU cannot hold.

Every other strategy here splits the batch or the weights; this one splits the sequence.
Each sample's tokens are cut into 2 x cp chunks and rank r of a cp group holds chunks r
and 2cp-1-r: an early chunk and a late one, so that under the causal mask every rank does
the same attention work. Embeddings, MLPs, norms and the head are per token and need
nothing from other ranks; each token keeps its global position. Only attention needs
the whole sequence, and ring attention gives it: each rank keeps its queries while the
key/value blocks travel around the cp ranks, one hop per step, every step's partial
result merged into the running one through the log-sum-exp of its scores. Backward runs
the ring again and passes the key/value gradients around it back to their owners. The
transfers of the next block run while this block's attention computes.

The loss is each rank's mean over its own tokens (all ranks hold as many), and FSDP2
shards the weights over dp x cp, flattened (as torchtitan does), averaging gradients
over every rank: the same as the mean over the whole sequence and the global batch.

Costs: per block and micro-step a rank sends its key/value block cp-1 times in forward,
cp-1 times again in backward, and a key/value gradient block cp times (fp32), on top of
FSDP's gathers and reduce-scatters. Each rank holds 1/cp of the activations (and of the
logits, which dominate at long sequences), and does 1/cp of attention's quadratic work.

--cp-impl ring is this file's own (CPU and GPU; on a GPU it runs FlashAttention's
kernel, bf16). --cp-impl torch uses PyTorch's torch.distributed.tensor.experimental.
context_parallel, which shards the same chunks, by default all-gathers keys and values
instead of passing them around, and has no CPU kernel.

Launch:
    torchrun --standalone --nproc_per_node=8 context_parallel_train.py --model 2.5b-long --seq-len 65536 --global-batch-size 1
    torchrun --standalone --nproc_per_node=8 context_parallel_train.py --model 2.5b-long --seq-len 16384 --cp 4  # dp 2 x cp 4
    python context_parallel_train.py --model 2.5b-long --seq-len 65536 --global-batch-size 1 --simulate 8  # rank 0 of cp 8, on one GPU
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import common


def local_part(t, dim, cp_rank, cp):
    """This rank's chunks of a sequence cut into 2·cp along `dim`: r and 2cp-1-r."""
    chunks = t.chunk(2 * cp, dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim)


class Ring:
    """The cp group as a ring: each rank sends to the next and receives from the previous."""

    def __init__(self, group):
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def pass_on(self, tensor, tag=0):
        """Start sending `tensor` on and receiving the previous rank's; returns a wait() that
        gives the received tensor. Both run while the caller computes."""
        received = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                           dist.P2POp(dist.irecv, received, self.previous, self.group, tag)])

        def wait():
            for request in requests:
                request.wait()
            return received

        return wait


def block_attention(q, k, v, causal):
    """One block's attention, with each query's log-sum-exp of scores that the merge needs:
    SDPA's own fused kernel, called by its aten name because F.scaled_dot_product_attention
    does not return the log-sum-exp. Returns (out, lse, what the CUDA backward wants back)."""
    if q.device.type == "cpu":
        return (*torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal), ())
    out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return out, lse, (cum_q, cum_k, seed, offset)


def block_attention_backward(dout, q, k, v, out, lse, causal, aux):
    """One block's dq, dk, dv, given the MERGED output and log-sum-exp: with those, the
    block's softmax is already normalised over every key, so blocks' gradients just add."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    cum_q, cum_k, seed, offset = aux  # dense inputs, no dropout: passed back as the forward gave them, as torch's own ring does
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset)


def accumulate(t):
    """The dtype partial results add up in: fp32, or t's own where that is wider."""
    return torch.promote_types(t.dtype, torch.float32)


def merge(out, lse, block_out, block_lse):
    """Attention over two disjoint sets of keys from each one's: each output is weighted
    by its share of the total exp-sum of scores, exp(lse_part - lse_all)."""
    merged_lse = torch.logaddexp(lse, block_lse)
    merged = out * torch.exp(lse - merged_lse).unsqueeze(-1) + block_out.to(out.dtype) * torch.exp(block_lse - merged_lse).unsqueeze(-1)
    return merged, merged_lse


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, (B, heads, T/cp,
    head_dim) each, the local tokens being chunks r and 2cp-1-r. At ring step s this rank
    holds the key/value block of rank j = r - s (mod cp); of it, under the causal mask:
    j = r: its own block, causal within (its two chunks are in order);
    j < r: chunk j comes before both of ours, chunk 2cp-1-j after both: all our queries
           see j's first half;
    j > r: both of j's chunks lie between our two: only our second half sees them, all."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        half = q.shape[2] // 2
        kv = torch.stack([k, v])
        incoming = ring.pass_on(kv)
        out, lse, aux = block_attention(q, k, v, causal=True)
        out = out.to(accumulate(q))
        for step in range(1, ring.size):
            kv = incoming()
            if step < ring.size - 1:
                incoming = ring.pass_on(kv)
            if (ring.rank - step) % ring.size < ring.rank:
                block_out, block_lse, _ = block_attention(q, kv[0, :, :, :half], kv[1, :, :, :half], causal=False)
                out, lse = merge(out, lse, block_out, block_lse)
            else:
                block_out, block_lse, _ = block_attention(q[:, :, half:], kv[0], kv[1], causal=False)
                out[:, :, half:], lse[:, :, half:] = merge(out[:, :, half:], lse[:, :, half:], block_out, block_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.aux = ring, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, aux, half = ctx.ring, ctx.aux, q.shape[2] // 2
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        incoming = ring.pass_on(kv)
        dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, True, aux)
        dq = dq.to(accumulate(q))
        # The gradient of a key/value block travels with it, each rank adding its share;
        # fp32, so cp shares add without bf16 rounding. Tag 1 keeps it apart from the blocks.
        incoming_grad = ring.pass_on(torch.stack([dk, dv]).to(accumulate(q)), tag=1)
        second = [t[:, :, half:].contiguous() for t in (dout, q, out, lse)]
        for step in range(1, ring.size):
            kv = incoming()
            if step < ring.size - 1:
                incoming = ring.pass_on(kv)
            if (ring.rank - step) % ring.size < ring.rank:
                dq_part, dk_part, dv_part = block_attention_backward(dout, q, kv[0, :, :, :half], kv[1, :, :, :half], out, lse, False, aux)
                dq += dq_part
                dkv = incoming_grad()
                dkv[:, :, :, :half] += torch.stack([dk_part, dv_part])
            else:
                dq_part, dk_part, dv_part = block_attention_backward(second[0], second[1], kv[0], kv[1], second[2], second[3], False, aux)
                dq[:, :, half:] += dq_part
                dkv = incoming_grad()
                dkv += torch.stack([dk_part, dv_part])
            incoming_grad = ring.pass_on(dkv, tag=1)
        dkv = incoming_grad()  # this rank's own block's gradient, every rank's share added, home again
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def main():
    parser = common.base_parser(__doc__)
    parser.add_argument("--cp", type=common.positive, help="ranks one sequence is split over; data-parallel degree = world / cp (default: the world size)")
    parser.add_argument("--cp-impl", choices=["ring", "torch"], default="ring",
                        help="ring: this file's ring attention (CPU and GPU); torch: PyTorch's context_parallel (GPU only) (default: ring)")
    args, cfg = common.parse_args(parser)
    env = common.init_distributed(args)
    cp = env.world_size if args.cp is None else args.cp
    common.check(env.world_size % cp == 0, f"--cp {cp} must divide the world size {env.world_size}")
    dp = env.world_size // cp
    common.check(args.seq_len % (2 * cp) == 0, f"--seq-len {args.seq_len} must divide into 2 x --cp {cp} = {2 * cp} chunks of equal length")
    common.check(args.global_batch_size % (dp * args.grad_accum) == 0,
                 f"--global-batch-size {args.global_batch_size} must divide evenly over dp {dp} (world {env.world_size} / --cp {cp}) x --grad-accum {args.grad_accum}")
    common.check(args.cp_impl != "torch" or env.device.type == "cuda",
                 "--cp-impl torch runs PyTorch's context_parallel, which has no CPU attention kernel: use --cp-impl ring on the CPU")
    common.check(not (args.cp_impl == "ring" and cp > 1 and env.device.type == "cuda" and args.dtype == "fp32"),
                 "--cp-impl ring on a GPU runs FlashAttention's kernel, which takes bf16 or fp16: use --dtype bf16, or --cp-impl torch")
    common.refuse_fp16(args, "each rank's GradScaler would see only its own gradient shards, so ranks could disagree on skipping a step")

    # cp the inner dimension: its ranks are consecutive, on one node, where the ring's transfers run.
    mesh = common.make_mesh(env, dp=dp, cp=cp)
    cp_rank, dp_rank = mesh["cp"].get_local_rank(), mesh["dp"].get_local_rank()
    common.log(f"mesh dp {dp} x cp {cp}; rank 0's ring: ranks {mesh['cp'].mesh.tolist()}; {args.seq_len // cp} tokens of each sequence per rank")
    model = common.build_model(cfg, env.device, args, fsdp=True)
    loss_fn = common.make_loss_fn(args)
    if cp > 1 and args.cp_impl == "ring":
        ring = Ring(mesh["cp"].get_group())
        for block in model.blocks.values():
            block.attn.attention = lambda q, k, v: RingAttention.apply(q, k, v, ring)
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else MixedPrecisionPolicy()
    shard_mesh = mesh._flatten("dp_cp")
    for block in model.blocks.values():
        fully_shard(block, mesh=shard_mesh, mp_policy=precision)
    fully_shard(model, mesh=shard_mesh, mp_policy=precision)

    optimizer = common.make_optimizer(model, args)
    ckpt = common.checkpointer(args, cfg, model, optimizer)
    start_step = ckpt.load()
    if start_step >= args.steps:
        return
    if args.cp_impl == "torch":
        from torch.distributed.tensor.experimental import context_parallel

    # The cp ranks of one dp group read the same samples, and each keeps its chunks.
    micro_batch = args.global_batch_size // (dp * args.grad_accum)
    batches = common.make_batches(args, cfg, env.device, micro_batch, dp_rank, dp, start_step)
    tlog = common.TrainLog(args, env, cfg, "cp", optimizer, start_step, hooks=[ckpt])
    batches = tlog.timed_batches(batches)
    for step in tlog.steps():
        lr = common.set_lr(optimizer, step, args)
        loss = torch.zeros((), device=env.device)
        for _ in range(args.grad_accum):
            x, y = next(batches)
            positions = torch.arange(args.seq_len, device=env.device)
            if cp > 1 and args.cp_impl == "torch":  # it shards these in place, into the same chunks
                sharded = context_parallel(mesh["cp"], buffers=[x, y, positions], buffer_seq_dims=[1, 1, 0])
            else:
                x, y, positions, sharded = local_part(x, 1, cp_rank, cp), local_part(y, 1, cp_rank, cp), local_part(positions, 0, cp_rank, cp), nullcontext()
            with sharded:
                micro_loss = loss_fn(model(x, positions), y) / args.grad_accum
                micro_loss.backward()
            loss += micro_loss.detach()
        grad_norm = common.clip_grad_norm_(optimizer, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Each rank holds the mean over its own tokens, as many on every rank: the
        # shares (loss / world) sum to the mean over the whole global batch.
        if tlog.end_step(step, loss / env.world_size, grad_norm, lr):  # SIGTERM: saved, stop
            break

    tlog.finish(mesh={"dp": dp, "cp": cp}, cp_impl=args.cp_impl, tokens_per_rank=args.seq_len // cp)


if __name__ == "__main__":
    common.run(main)
