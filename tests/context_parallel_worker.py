"""What each rank of a context-parallel test launch runs: the training run
context_parallel_train.py makes of its command line, then, on the same process group, ring
attention against F.scaled_dot_product_attention on random causal inputs for each cp in
RING_CHECK_CPS (each over ranks 0 .. cp-1), the largest differences over every rank
written by rank 0 as JSON to RING_CHECK_OUT."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import context_parallel_train as cp_train  # noqa: E402


def ring_differences(cp, group):
    """Largest |ring - SDPA| of this rank's output and q, k, v gradients, in float64 (0 for
    ranks outside the ring). 3 tokens a chunk: every block's halves are uneven against the
    kernels' tiles."""
    gen = torch.Generator().manual_seed(cp)
    q, k, v, dout = (torch.randn(2, 3, 2 * cp * 3, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    if group is None:
        return torch.zeros(4, dtype=torch.float64)
    ring = cp_train.Ring(group)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=True)
    expected.backward(dout)
    mine = [cp_train.local_part(t, 2, ring.rank, cp).requires_grad_() for t in (q, k, v)]
    out = cp_train.RingAttention.apply(*mine, ring)
    out.backward(cp_train.local_part(dout, 2, ring.rank, cp))
    pairs = [(out, expected)] + [(m.grad, w.grad) for m, w in zip(mine, whole)]
    # Detached: a graph left on the result would hold the Ring, and so its process group,
    # inside the all-reduce that gloo's worker thread frees, at exit.
    return torch.stack([(a - cp_train.local_part(b, 2, ring.rank, cp)).abs().max() for a, b in pairs]).detach()


def main():
    cp_train.main()
    report = {}
    for cp in map(int, os.environ["RING_CHECK_CPS"].split(",")):
        group = dist.new_group(list(range(cp)))  # every rank takes part in making it
        diffs = ring_differences(cp, group if dist.get_rank() < cp else None)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        report[cp] = dict(zip(["out", "dq", "dk", "dv"], diffs.tolist()))
    if dist.get_rank() == 0:
        with open(os.environ["RING_CHECK_OUT"], "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    common.run(main)
