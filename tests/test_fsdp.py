"""FSDP must compute the same training run as one process, with 1/world of the training
state on each rank."""

import pytest
from harness import assert_losses_match, checkpointed, launch, reference, run_script

# One launch per case, each covering some of the switches: ZeRO-2-like resharding and
# gradient accumulation at 4 ranks, CPU offload and activation checkpointing at 2.
CASES = {
    "2 ranks": (2,),
    "4 ranks, no reshard after forward, grad-accum": (4, "--no-reshard-after-forward", "--grad-accum", "2"),
    "2 ranks, cpu offload, activation checkpointing": (2, "--cpu-offload", "--activation-checkpointing"),
}


def assert_grad_norms_match(run, ref, rtol=1e-4):
    # Gradient norms before clipping: a wrong reduction shows here even where Adam's
    # normalised step would hide it in the loss.
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=rtol)


@pytest.mark.parametrize("case", CASES)
def test_fsdp_matches_single_process(case):
    nproc, *extra = CASES[case]
    # The plain run also saves checkpoints, which test_checkpoint resumes from.
    run = launch("fsdp_train.py", nproc, *extra) if extra else checkpointed("fsdp_train.py", nproc)[0]
    assert run["strategy"] == "fsdp" and run["world_size"] == nproc
    assert run["cpu_offload"] == ("--cpu-offload" in extra)
    assert run["reshard_after_forward"] == ("--no-reshard-after-forward" not in extra)
    assert_losses_match(run, reference())
    assert_grad_norms_match(run, reference())


def test_shards_shrink_with_ranks():
    """Each rank holds 1/world of the fp32 parameters, as much gradient, and twice that
    in Adam's two moments; so the shards halve from 2 to 4 ranks."""
    runs = [checkpointed("fsdp_train.py", 2)[0], launch("fsdp_train.py", *CASES["4 ranks, no reshard after forward, grad-accum"])]
    for run in runs:
        expected = 4 * run["params"] / run["world_size"]
        assert run["param_shard_bytes"] == pytest.approx(expected, rel=0.02)
        assert run["grad_shard_bytes"] == pytest.approx(expected, rel=0.02)
        assert run["optim_shard_bytes"] == pytest.approx(2 * expected, rel=0.02)
        peaks = run["peak_mem_gib_per_rank"]
        assert len(peaks) == run["world_size"] and min(peaks) > 0
        assert max(peaks) == pytest.approx(run["peak_mem_gib"], abs=0.05)  # the record's peak is the largest rank's
    two, four = runs
    assert four["param_shard_bytes"] < 0.6 * two["param_shard_bytes"]
    assert four["optim_shard_bytes"] < 0.6 * two["optim_shard_bytes"]


def test_bad_configuration_fails_at_once_with_one_line():
    # A world of one without torchrun, so the exit status is the script's own.
    proc, records = run_script("fsdp_train.py", 1, ["--global-batch-size", "6", "--grad-accum", "4"], timeout=60, torchrun=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --global-batch-size 6 "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert records == []
