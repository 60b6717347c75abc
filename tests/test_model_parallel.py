"""Naive model parallelism must compute the single-process run, whatever the split."""

import pytest
import common
from harness import assert_losses_match, checkpointed, comm, launch, reference


@pytest.mark.parametrize("nproc,extra", [
    (2, []),
    (4, ["--grad-accum", "2", "--activation-checkpointing"]),
    (2, ["--split", "2,6"]),
], ids=["2-ranks", "4-ranks-accum-checkpointing", "uneven-split"])
def test_model_parallel_matches_single_process(nproc, extra):
    # The plain run also saves checkpoints, which test_checkpoint resumes from.
    run = launch("model_parallel_train.py", nproc, *extra) if extra else checkpointed("model_parallel_train.py", nproc)[0]
    assert_losses_match(run, reference())
    assert run["split"] == ([2, 6] if "--split" in extra else [8 // nproc] * nproc)
    busy = run["busy_pct_per_rank"]
    assert len(busy) == nproc and all(0 < b < 100 for b in busy) and min(run["transfer_pct_per_rank"]) > 0
    if "--split" in extra:
        # Wall-clock shares: under load their ratio drifts, their order does not.
        assert busy[1] > busy[0], f"the rank with 3x the blocks should be the busy one: {busy}"
    # Rank 0 sends each micro-step's whole batch of activations (B x T x d, fp32) to rank 1
    # and receives their gradient: one message each way, nothing else but the norm.
    grad_accum = int(extra[extra.index("--grad-accum") + 1]) if "--grad-accum" in extra else 1
    activation = run["global_batch_size"] // grad_accum * run["seq_len"] * common.PRESETS["tiny"].d_model * 4
    assert comm(run, "send")[:2] == comm(run, "recv")[:2] == (grad_accum, grad_accum * activation)
