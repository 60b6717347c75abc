"""Every check of a size made before training, at its boundary: exactly enough passes (the
script goes on to make its optimizer, every check behind it), one short is refused in
one line naming it. Each runs the script's own main() in this process, as rank 0 of a
world of --simulate N ranks where the world's size decides."""

import importlib
import struct
import sys

import pytest
import torch
import torch.distributed as dist

import common
from harness import TINY
from test_options import parser_of

# TINY: the tiny preset (8 blocks, 4 heads, context 64), --seq-len 32, --global-batch-size 8,
# --steps 4, --timing-warmup-steps 1.
# What is checked, the script, arguments exactly at the boundary, and arguments one past it
# with the words of their refusal.
BOUNDARIES = [
    ("seq-len", "ddp_train.py", ["--seq-len", "64"], [(["--seq-len", "65"], "--seq-len 65 exceeds the tiny preset's context of 64")]),
    ("lr-warmup", "fsdp_train.py", ["--lr-warmup-steps", "4"], [(["--lr-warmup-steps", "5"], "--lr-warmup-steps 5 must be at most --steps 4")]),
    ("timing-warmup", "pipeline_train.py", ["--timing-warmup-steps", "3"],
     [(["--timing-warmup-steps", "4"], "--timing-warmup-steps 4 leaves no step of --steps 4 to time")]),
    ("profile", "ddp_train.py", ["--profile", "{tmp}/trace", "--steps", "5"],
     [(["--profile", "{tmp}/trace", "--steps", "4"], "it needs --steps of at least 5")]),
    ("simulate-rank", "fsdp_train.py", ["--simulate", "4", "--simulate-rank", "3"],
     [(["--simulate", "4", "--simulate-rank", "4"], "--simulate-rank 4 must be below --simulate 4")]),
    ("data length", "ddp_train.py", ["--data", "{tmp}/enough.bin"],
     [(["--data", "{tmp}/short.bin"], "holds 33 tokens; one sample needs --seq-len + 2 = 34")]),
    ("data vocabulary", "ddp_train.py", ["--data", "{tmp}/ids.bin", "--vocab-size", "1000"],
     [(["--data", "{tmp}/ids.bin", "--vocab-size", "999"], "holds token id 999, beyond the vocabulary of 999: set --vocab-size 1000")]),
    # Batches: a micro-batch of one sample on every data-parallel rank passes; a batch that
    # does not divide (fewer samples, or more but not a multiple) is refused.
    ("ddp batch", "ddp_train.py", ["--simulate", "4", "--grad-accum", "2", "--global-batch-size", "8"],
     [(["--simulate", "4", "--grad-accum", "2", "--global-batch-size", "7"], "--global-batch-size 7 must divide evenly over 4 ranks x --grad-accum 2"),
      (["--simulate", "4", "--grad-accum", "2", "--global-batch-size", "12"], "--global-batch-size 12 must divide evenly over 4 ranks x --grad-accum 2")]),
    ("fsdp batch", "fsdp_train.py", ["--simulate", "4", "--grad-accum", "2", "--global-batch-size", "8"],
     [(["--simulate", "4", "--grad-accum", "2", "--global-batch-size", "12"], "--global-batch-size 12 must divide evenly over 4 ranks x --grad-accum 2")]),
    ("tp batch over dp", "tensor_parallel_train.py", ["--simulate", "4", "--dp", "2", "--grad-accum", "2", "--global-batch-size", "4"],
     [(["--simulate", "4", "--dp", "2", "--grad-accum", "2", "--global-batch-size", "6"], "--global-batch-size 6 must divide evenly over --dp 2 x --grad-accum 2")]),
    ("cp batch over dp", "context_parallel_train.py", ["--simulate", "4", "--cp", "2", "--grad-accum", "2", "--global-batch-size", "4"],
     [(["--simulate", "4", "--cp", "2", "--grad-accum", "2", "--global-batch-size", "6"], "--global-batch-size 6 must divide evenly over dp 2")]),
    # 3 micro-batches over 2 stages: a batch for dp 2 that is no multiple of the world, 4.
    ("hybrid batch", "hybrid_train.py", ["--simulate", "4", "--pp", "2", "--grad-accum", "2", "--micro-batches", "3", "--global-batch-size", "12"],
     [(["--simulate", "4", "--pp", "2", "--grad-accum", "2", "--micro-batches", "3", "--global-batch-size", "6"],
       "--global-batch-size 6 must divide into dp 2 x --grad-accum 2 x --micro-batches 3"),
      (["--simulate", "4", "--pp", "2", "--grad-accum", "2", "--micro-batches", "3", "--global-batch-size", "16"],
       "--global-batch-size 16 must divide into dp 2 x --grad-accum 2 x --micro-batches 3")]),
    ("pipeline batch", "pipeline_train.py", ["--simulate", "2", "--grad-accum", "2", "--micro-batches", "2", "--global-batch-size", "4"],
     [(["--simulate", "2", "--grad-accum", "2", "--micro-batches", "2", "--global-batch-size", "6"],
       "--global-batch-size 6 must divide into --grad-accum 2 x --micro-batches 2")]),
    ("model-parallel batch", "model_parallel_train.py", ["--grad-accum", "8"],
     [(["--grad-accum", "3"], "--global-batch-size 8 must divide by --grad-accum 3"), (["--grad-accum", "16"], "--global-batch-size 8 must divide by --grad-accum 16")]),
    # Splits of the model, the sequence and the world.
    ("pipeline stages", "pipeline_train.py", ["--simulate", "8", "--micro-batches", "8"],
     [(["--simulate", "9", "--micro-batches", "9", "--global-batch-size", "9"], "9 pipeline stages but only 8 blocks")]),
    ("interleaved stages", "pipeline_train.py", ["--simulate", "4", "--schedule", "interleaved-1f1b", "--micro-batches", "4"],
     [(["--simulate", "3", "--schedule", "interleaved-1f1b", "--stages-per-rank", "3", "--micro-batches", "3", "--global-batch-size", "9"],
       "9 pipeline stages but only 8 blocks")]),
    ("model-parallel ranks", "model_parallel_train.py", ["--simulate", "8"], [(["--simulate", "9"], "9 pipeline stages but only 8 blocks")]),
    ("split", "pipeline_train.py", ["--simulate", "2", "--split", "1,7"],
     [(["--simulate", "2", "--split", "1,8"], "--split 1,8 must give every part at least one block and 8 in all"),
      (["--simulate", "2", "--split", "1,1,6"], "--split 1,1,6 names 3 parts, but there are 2")]),
    ("micro-batches per stage", "pipeline_train.py", ["--simulate", "2", "--schedule", "1f1b", "--micro-batches", "2"],
     [(["--simulate", "2", "--schedule", "1f1b", "--micro-batches", "1"], "--schedule 1f1b cannot run 1 micro-batches over 2 stages")]),
    ("stages per rank, interleaved", "hybrid_train.py", ["--simulate", "4", "--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--micro-batches", "2"],
     [(["--simulate", "4", "--schedule", "interleaved-1f1b", "--stages-per-rank", "1", "--micro-batches", "2"],
       "--schedule interleaved-1f1b needs --stages-per-rank of at least 2")]),
    ("stages per rank, zbv", "pipeline_train.py", ["--simulate", "2", "--schedule", "zbv", "--stages-per-rank", "2"],
     [(["--simulate", "2", "--schedule", "zbv", "--stages-per-rank", "3"], "--schedule zbv places exactly 2 stages per rank")]),
    ("stages per rank, 1f1b", "pipeline_train.py", ["--simulate", "2", "--stages-per-rank", "1"],
     [(["--simulate", "2", "--stages-per-rank", "2"], "--schedule 1f1b runs one stage per rank")]),
    ("pp divides the world", "hybrid_train.py", ["--simulate", "4", "--pp", "4"],
     [(["--simulate", "4", "--pp", "3"], "world size 4 is not divisible by --pp 3")]),
    ("tp heads", "tensor_parallel_train.py", ["--simulate", "4"], [(["--simulate", "8"], "4 heads cannot be split over tp 8")]),
    ("tp dp divides the world", "tensor_parallel_train.py", ["--simulate", "4", "--dp", "4"],
     [(["--simulate", "4", "--dp", "3"], "--dp 3 must divide the world size 4")]),
    ("sequence-parallel tokens", "tensor_parallel_train.py", ["--simulate", "2", "--sequence-parallel", "--seq-len", "30"],
     [(["--simulate", "2", "--sequence-parallel", "--seq-len", "31"], "--sequence-parallel splits --seq-len 31 over tp 2")]),
    ("cp chunks", "context_parallel_train.py", ["--simulate", "4", "--seq-len", "8"],
     [(["--simulate", "4", "--seq-len", "12"], "--seq-len 12 must divide into 2 x --cp 4 = 8 chunks"),
      (["--simulate", "4", "--seq-len", "4"], "--seq-len 4 must divide into 2 x --cp 4 = 8 chunks")]),
    ("cp divides the world", "context_parallel_train.py", ["--simulate", "4", "--cp", "4"],
     [(["--simulate", "4", "--cp", "3"], "--cp 3 must divide the world size 4")]),
]


class Accepted(Exception):
    """Every check before training passed: the script went on to make its optimizer."""


def accept(*_, **__):
    raise Accepted


@pytest.fixture
def files(tmp_path):
    """Token files of 34 (one sample of --seq-len 32 and the draw's one more) and 33 tokens,
    and one whose largest id, 999, comes last."""
    (tmp_path / "enough.bin").write_bytes(struct.pack("<34H", *range(34)))
    (tmp_path / "short.bin").write_bytes(struct.pack("<33H", *range(33)))
    (tmp_path / "ids.bin").write_bytes(struct.pack("<40H", *range(39), 999))
    return tmp_path


def checked(script, argv, capsys, monkeypatch):
    """Run a script's main() under common.run as `python script.py ARGV`, up to its
    optimizer; returns "accepted", or (exit status, stderr lines) of its refusal."""
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(common, "make_optimizer", accept)
    monkeypatch.setattr(dist, "recv", dist.recv)  # --simulate replaces it: put back after the test
    monkeypatch.setattr(sys, "argv", [script, *TINY, *argv])
    try:
        common.run(module.main)
    except Accepted:
        return "accepted"
    except SystemExit as e:
        return e.code, capsys.readouterr().err.splitlines()
    finally:
        assert not dist.is_initialized(), "the process group outlived the run"
    raise AssertionError("main() returned without reaching its optimizer")


@pytest.mark.parametrize("script,enough,short", [row[1:] for row in BOUNDARIES], ids=[row[0] for row in BOUNDARIES])
def test_exactly_enough_passes_and_one_short_is_refused_in_one_line(script, enough, short, files, capsys, monkeypatch):
    fill = lambda argv: [a.format(tmp=files) for a in argv]
    assert checked(script, fill(enough), capsys, monkeypatch) == "accepted", (script, enough)
    for argv, message in short:
        code, lines = checked(script, fill(argv), capsys, monkeypatch)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (argv, lines)


def test_powersgd_must_start_before_the_last_step(capsys, monkeypatch):
    """Only a real world of two ranks compresses (a simulated one refuses PowerSGD): here one
    without a process group, up to the model, which the check comes before."""
    import ddp_train

    monkeypatch.setattr(common, "init_distributed", lambda args: common.Env(0, 2, 0, torch.device("cpu")))
    monkeypatch.setattr(common, "build_model", accept)
    for start, accepted in ((3, True), (4, False)):
        monkeypatch.setattr(sys, "argv", ["ddp_train.py", *TINY, "--comm-hook", "powersgd", "--powersgd-start-iter", str(start)])
        with pytest.raises(Accepted if accepted else SystemExit) as ended:
            common.run(ddp_train.main)
        if not accepted:
            lines = capsys.readouterr().err.splitlines()
            assert ended.value.code == 2 and len(lines) == 1, lines
            assert lines[0].startswith("error: --powersgd-start-iter 4 is not below --steps 4"), lines


# A number's range, read by argparse: (script, option, the extreme accepted, the nearest refused).
RANGES = [
    ("ddp_train.py", "--steps", "1", "0"), ("ddp_train.py", "--num-workers", "0", "-1"), ("ddp_train.py", "--grad-accum", "1", "0"),
    ("ddp_train.py", "--lr", "1e-30", "0"), ("ddp_train.py", "--grad-clip", "0", "-1e-9"), ("ddp_train.py", "--weight-decay", "0", "-1e-9"),
    ("ddp_train.py", "--seed", "4294967295", "4294967296"), ("ddp_train.py", "--seed", "0", "-1"),
    ("ddp_train.py", "--timeout", "1", "0.999"), ("ddp_train.py", "--timeout", "604800", "604801"),
    ("ddp_train.py", "--simulate", "2", "1"), ("ddp_train.py", "--simulate", "4096", "4097"), ("ddp_train.py", "--simulate-rank", "0", "-1"),
    ("ddp_train.py", "--lr-warmup-steps", "0", "-1"), ("ddp_train.py", "--timing-warmup-steps", "0", "-1"),
    ("ddp_train.py", "--log-every", "1", "0"), ("ddp_train.py", "--checkpoint-every", "0", "-1"), ("ddp_train.py", "--vocab-size", "1", "0"),
    ("ddp_train.py", "--powersgd-start-iter", "2", "1"),
    ("pipeline_train.py", "--micro-batches", "1", "0"), ("pipeline_train.py", "--stages-per-rank", "1", "0"),
    ("pipeline_train.py", "--split", "1,7", "0,8"), ("model_parallel_train.py", "--split", "1,7", "1,-7"),
    ("hybrid_train.py", "--pp", "1", "0"), ("tensor_parallel_train.py", "--dp", "1", "0"), ("context_parallel_train.py", "--cp", "1", "0"),
]


@pytest.mark.parametrize("script,option,accepted,refused", RANGES, ids=[f"{s.removesuffix('_train.py')} {o} {a}|{r}" for s, o, a, r in RANGES])
def test_a_number_at_the_end_of_its_range_is_taken_and_the_next_refused(script, option, accepted, refused, capsys, monkeypatch):
    parser = parser_of(script, monkeypatch)
    assert getattr(parser.parse_args([f"{option}={accepted}"]), option.removeprefix("--").replace("-", "_")) is not None
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([f"{option}={refused}"])
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: argument {option}: '{refused}' is not"), lines
