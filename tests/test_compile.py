"""What --compile and tensor parallelism change in what a rank runs, read off the rank
itself: dynamo's counters (a simulated --compile rank traces its blocks, as a real one
does) and the matmul FLOPs a tensor-parallel rank computes (they fall by tp)."""

import json

import pytest

from harness import run_script

# A simulated rank of each strategy that compiles, with the flags that make its world.
SIMULATED = [("ddp_train.py", 2, []), ("fsdp_train.py", 2, []), ("tensor_parallel_train.py", 2, []),
             ("tensor_parallel_train.py", 2, ["--sequence-parallel"]), ("tensor_parallel_train.py", 4, ["--dp", "2"]),
             ("pipeline_train.py", 2, []), ("pipeline_train.py", 2, ["--schedule", "interleaved-1f1b", "--simulate-rank", "1"]),
             ("hybrid_train.py", 4, []), ("model_parallel_train.py", 2, ["--simulate-rank", "1"]), ("context_parallel_train.py", 2, [])]


def instrumented(script, what, args):
    """The report tests/instrumented_worker.py prints for this run of `script`."""
    proc, records = run_script("tests/instrumented_worker.py", 1, args, env={"STRATEGY": script, "INSTRUMENT": what},
                               torchrun=False, forked=True)
    assert proc.returncode == 0 and records, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("INSTRUMENT ")[-1])


@pytest.mark.parametrize("script,n,args", SIMULATED, ids=[f"{s.removesuffix('_train.py')} x{n} {' '.join(a)}" for s, n, a in SIMULATED])
def test_a_simulated_compile_rank_traces_its_blocks(script, n, args):
    """Its first step must not run under a dispatch mode (dynamo would skip the blocks for
    good), nor its counted last step: the rank the sweep times is the compiled one."""
    run = ["--simulate", n, "--steps", 2, "--timing-warmup-steps", 0, "--lr-warmup-steps", 0, *args]
    compiled = instrumented(script, "dynamo", [*run, "--compile"])
    assert compiled["frames"] >= 1 and compiled["graphs"] >= 1, compiled
    if script == "tensor_parallel_train.py":
        # One graph, the block's: a compiled loss under loss_parallel would bake this rank's
        # vocabulary offset into a second graph, which the compile cache hands to every rank.
        assert (compiled["graphs"], compiled["graph_breaks"]) == (1, 0), compiled


def test_without_compile_nothing_is_traced():
    assert instrumented("ddp_train.py", "dynamo", ["--simulate", 2, "--steps", 2])["frames"] == 0


@pytest.mark.parametrize("sequence_parallel", [[], ["--sequence-parallel"]], ids=["plain", "sequence-parallel"])
def test_a_tensor_parallel_ranks_matmul_flops_fall_by_tp(sequence_parallel):
    one_step = ["--steps", 1, "--timing-warmup-steps", 0, "--lr-warmup-steps", 0, *sequence_parallel]
    flops = {tp: instrumented("tensor_parallel_train.py", "flops", [*one_step, *(["--simulate", tp] if tp > 1 else [])])["aten.mm"]
             for tp in (1, 2, 4)}
    assert flops[2] * 2 == flops[1] and flops[4] * 4 == flops[1], flops
