"""Context parallelism must compute the single-process run with each sequence split over
cp ranks, its ring attention must equal SDPA's, and its transfers must be the textbook's.
Each launch trains AND checks ring attention (tests/context_parallel_worker.py)."""

import functools
import json
import os
import tempfile

import pytest

import common
from harness import assert_losses_match, comm, launch, reference, run_script
from test_errors import refuse_in_process
from test_fsdp import assert_textbook_communication

# world size, extra flags, the cp degrees whose ring attention the launch checks
CASES = {
    "cp 2, grad-accum": (2, ("--grad-accum", "2"), "2"),
    "cp 4": (4, (), "3,4"),
    "dp 2 x cp 2": (4, ("--cp", "2"), "2"),
}


@functools.lru_cache(maxsize=None)
def launch_and_check(case):
    """(results record, {cp: largest ring-vs-SDPA differences}) of one launch."""
    nproc, extra, cps = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ring.json")
        proc, records = run_script("tests/context_parallel_worker.py", nproc, extra, env={"RING_CHECK_CPS": cps, "RING_CHECK_OUT": out}, forked=True)
        assert proc.returncode == 0 and len(records) == 1, f"{case} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        with open(out) as f:
            return records[0], {int(cp): diffs for cp, diffs in json.load(f).items()}


@pytest.mark.parametrize("cp,case", [(2, "cp 2, grad-accum"), (3, "cp 4"), (4, "cp 4")])
def test_ring_attention_equals_sdpa_output_and_gradients(cp, case):
    diffs = launch_and_check(case)[1][cp]
    assert max(diffs.values()) < 1e-10, diffs  # float64: only rounding differs


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_matches_single_process(case):
    run, _ = launch_and_check(case)
    nproc, extra, _ = CASES[case]
    cp = int(extra[extra.index("--cp") + 1]) if "--cp" in extra else nproc
    grad_accum = int(extra[extra.index("--grad-accum") + 1]) if "--grad-accum" in extra else 1
    assert run["strategy"] == "cp" and run["mesh"] == {"dp": nproc // cp, "cp": cp} and run["tokens_per_rank"] == run["seq_len"] // cp
    assert_losses_match(run, reference())
    assert run["grad_norms"] == pytest.approx(reference()["grad_norms"], rel=1e-4)
    assert_textbook_ring(run, cp, grad_accum)
    # FSDP over the flattened dp x cp mesh, its gathers and reduce-scatters as fsdp_train.py's.
    assert_textbook_communication({**run, "reshard_after_forward": True}, grad_accum=grad_accum)


def assert_textbook_ring(run, cp, grad_accum=1):
    """Per block and micro-step, among rank 0's ring (ranks 0 .. cp-1): its key/value block
    (K and V, micro-batch x T/cp x d each, fp32) goes on cp-1 times in forward and cp-1
    times in backward, and the block's gradient cp times: around the ring and home."""
    cfg = common.PRESETS[run["model"]]
    block = 2 * (run["global_batch_size"] // run["mesh"]["dp"] // grad_accum) * run["seq_len"] // cp * cfg.d_model * 4
    messages = grad_accum * cfg.n_layers * (3 * cp - 2)
    for kind in ("send", "recv"):
        assert comm(run, kind, list(range(cp))) == (messages, messages * block, {"float32"}), kind
        assert comm(run, kind)[0] == messages  # nothing beyond the ring


@pytest.mark.parametrize("case", CASES)
def test_a_simulated_rank_sends_what_a_real_one_sends(case):
    real = launch_and_check(case)[0]
    nproc, extra, _ = CASES[case]
    sim = launch("context_parallel_train.py", 1, "--simulate", nproc, *extra)
    assert sim["simulated_rank"] == 0 and sim["mesh"] == real["mesh"]
    assert sim["comm_per_step"] == real["comm_per_step"]


@pytest.mark.parametrize("argv,message", [
    (["--simulate", "3", "--cp", "3"], "error: --seq-len 32 must divide into 2 x --cp 3 = 6 chunks of equal length"),
    (["--simulate", "4", "--cp", "3"], "error: --cp 3 must divide the world size 4"),
    (["--cp-impl", "torch"], "error: --cp-impl torch runs PyTorch's context_parallel, which has no CPU attention kernel"),
])
def test_what_cannot_split_is_refused_in_one_line(argv, message, capsys, monkeypatch):
    code, lines = refuse_in_process("context_parallel_train.py", argv, capsys, monkeypatch)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(message), lines
