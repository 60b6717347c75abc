"""Tensor parallelism, alone and under FSDP (2-D), must compute the same training run as
one process."""

import pytest
from harness import assert_losses_match, checkpointed, launch, reference, run_script

# One launch per layout; sequence parallelism, activation checkpointing and gradient
# accumulation ride along so that each switch runs at least once.
CASES = {
    "tp 2": (2,),
    "tp 4, sequence parallel, activation checkpointing": (4, "--sequence-parallel", "--activation-checkpointing"),
    "dp 2 x tp 2, sequence parallel, grad-accum": (4, "--dp", "2", "--sequence-parallel", "--grad-accum", "2"),
}


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_matches_single_process(case):
    nproc, *extra = CASES[case]
    # The plain run also saves checkpoints, which test_checkpoint resumes from.
    run = launch("tensor_parallel_train.py", nproc, *extra) if extra else checkpointed("tensor_parallel_train.py", nproc)[0]
    dp = int(extra[extra.index("--dp") + 1]) if "--dp" in extra else 1
    assert run["strategy"] == "tp" and run["mesh"] == {"dp": dp, "tp": nproc // dp}
    assert run["sequence_parallel"] == ("--sequence-parallel" in extra)
    assert_losses_match(run, reference())
    # Gradient norms before clipping: a missing all-reduce shows here even where Adam's
    # normalised step would hide it in the loss.
    assert run["grad_norms"] == pytest.approx(reference()["grad_norms"], rel=1e-4)


def test_heads_not_divisible_by_tp_fail_at_once_with_one_line():
    proc, records = run_script("tensor_parallel_train.py", 3, [], timeout=60)  # tiny has 4 heads
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "4 heads" in errors[0] and "tp 3" in errors[0], proc.stderr[-3000:]
    # torchrun exits 1 whenever a rank fails; its report shows each rank's own status.
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 2") >= 1, proc.stderr[-3000:]
    assert "[rank" not in proc.stderr, "a rank printed a traceback"
    assert records == []
