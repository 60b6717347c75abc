"""FSDP must compute the same training run as one process, with 1/world of the training
state on each rank."""

import pytest
import common
from harness import assert_losses_match, checkpointed, comm, launch, reference, run_script

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
    cfg = common.PRESETS["tiny"]
    blocks_params = cfg.n_layers * len(list(common.Block(cfg).parameters()))  # what fsdp_train counts
    assert run["params_offloaded_to_cpu"] == (blocks_params if "--cpu-offload" in extra else 0)
    assert run["reshard_after_forward"] == ("--no-reshard-after-forward" not in extra)
    assert_losses_match(run, reference())
    assert_grad_norms_match(run, reference())
    assert_textbook_communication(run, grad_accum=2 if "--grad-accum" in extra else 1)


def assert_textbook_communication(run, grad_accum, gather_dtype="float32"):
    """Per micro-step, each block (one FSDP unit) is all-gathered before its forward and
    again before its backward (once, kept between them, with --no-reshard-after-forward)
    and its gradients reduce-scattered; the root (embeddings, norm, head) is gathered once."""
    cfg = common.PRESETS[run["model"]]
    block = 12 * cfg.d_model**2 + 4 * cfg.d_model  # tiny's shapes split over 2 or 4 ranks without padding
    blocks, root = cfg.n_layers * block, run["params"] - cfg.n_layers * block
    gathers = 2 if run["reshard_after_forward"] else 1
    width = 2 if gather_dtype == "bfloat16" else 4
    assert comm(run, "all_gather") == (grad_accum * (gathers * cfg.n_layers + 1), grad_accum * width * (gathers * blocks + root), {gather_dtype})
    # Gradients are reduced in fp32 whatever the compute dtype (MixedPrecisionPolicy's reduce_dtype).
    assert comm(run, "reduce_scatter") == (grad_accum * (cfg.n_layers + 1), grad_accum * 4 * run["params"], {"float32"})
    assert comm(run, "all_reduce")[0] == 1  # the gradient norm, once


def test_bf16_gathers_weights_in_bf16_and_reduces_gradients_in_fp32():
    run = launch("fsdp_train.py", 2, "--dtype", "bf16", "--no-reshard-after-forward")
    assert_textbook_communication(run, grad_accum=1, gather_dtype="bfloat16")
    assert max(abs(a - b) for a, b in zip(run["losses"], reference()["losses"])) < 0.05  # bf16 matmuls: close, not equal


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
    proc, records = run_script("fsdp_train.py", 1, ["--global-batch-size", "6", "--grad-accum", "4"], timeout=60, torchrun=False, forked=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --global-batch-size 6 "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert records == []
