"""Tensor parallelism, alone and under FSDP (2-D), must compute the same training run as
one process."""

import json

import pytest
import common
from harness import assert_losses_match, checkpointed, comm, launch, reference, run_script, simulate

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
    # Per block, attention and MLP each end in a row-parallel matmul whose partial sums are
    # combined in forward, and their column-parallel inputs' gradients in backward: 4 of
    # activation size (a micro-batch's B x T x d in fp32). Without sequence parallelism
    # each is an all-reduce; with it, a reduce-scatter and an all-gather of the same size.
    # Activation checkpointing recomputes forward in backward, collectives included.
    cfg = common.PRESETS["tiny"]
    grad_accum = int(extra[extra.index("--grad-accum") + 1]) if "--grad-accum" in extra else 1
    micro_batch = run["global_batch_size"] // (dp * grad_accum)
    textbook = 4 * grad_accum * cfg.n_layers * micro_batch * run["seq_len"] * cfg.d_model * 4
    low, high = (1.25, 1.6) if "--activation-checkpointing" in extra else (1.0, 1.2)
    tp_group = list(range(nproc // dp))  # rank 0's: tp is the inner, consecutive dimension
    kinds = ("reduce_scatter", "all_gather") if run["sequence_parallel"] else ("all_reduce",)
    for kind in kinds:
        nbytes = comm(run, kind, tp_group)[1]
        assert low * textbook <= nbytes < high * textbook, (kind, nbytes / textbook)
    if run["sequence_parallel"]:
        assert comm(run, "all_reduce", tp_group)[1] < 0.1 * textbook  # only the loss's and the norm's scalars
    else:
        assert comm(run, "reduce_scatter")[0] == comm(run, "all_gather")[0] == 0


def test_compiled_tensor_parallel_matches_the_eager_single_process_run():
    # The blocks compiled on DTensor weights, a path no other CPU test takes, against the
    # eager reference. AOTAutograd (aot_eager) is where compile takes DTensor apart into
    # local ops and collectives; inductor would add only its kernels for those (15 s of C++
    # builds on 2 cores), which the GPU runs exercise. The loss stays eager (a compiled one
    # would carry a rank's constants through the compile cache to the next run's other
    # ranks): one graph, the blocks'.
    proc, records = run_script("tests/instrumented_worker.py", 2, ["--compile"], forked=True,
                               env={"STRATEGY": "tensor_parallel_train.py", "INSTRUMENT": "dynamo", "BACKEND": "aot_eager"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = records[0]
    assert record["config"]["compile"] and record["mesh"] == {"dp": 1, "tp": 2}
    compiled = json.loads(proc.stdout.split("INSTRUMENT ")[-1])  # the blocks did compile: parity is not the eager run's
    assert compiled["frames"] >= 1 and compiled["graphs"] == 1, compiled
    assert_losses_match(record, reference())
    assert record["grad_norms"] == pytest.approx(reference()["grad_norms"], rel=1e-4)


@pytest.mark.parametrize("sp", [(), ("--sequence-parallel",)], ids=["plain", "sequence parallel"])
def test_under_bf16_every_block_sends_its_activations_in_bf16(sp):
    # Autocast's LayerNorm outputs fp32; the script casts it before the tp boundary, so the
    # 4 activation collectives of each block and the head's input gradient move 2 bytes an
    # element, forward and backward. Only the embeddings' output crosses in fp32.
    run = simulate("tensor_parallel_train.py", 2, 0, "--dtype", "bf16", *sp)
    cfg = common.PRESETS[run["model"]]
    stream = run["global_batch_size"] * run["seq_len"] * cfg.d_model  # elements, whole on a rank
    kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    for kind in kinds:
        calls, sent, _ = comm(run, kind, [0, 1], dtype="bfloat16")
        assert (calls, sent) == (4 * cfg.n_layers + 1, (4 * cfg.n_layers + 1) * stream * 2), kind
        assert comm(run, kind, [0, 1], dtype="float32")[1] <= 2 * stream * 4, kind
