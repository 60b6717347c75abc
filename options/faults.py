"""TRAIN_FAULT=KIND:STEP[:RANK]: the faults the tests inject, from the environment.

kill: SIGKILL during STEP; hang: stop answering during STEP; raise: an exception nobody
catches (a bug) during STEP; nan: the loss of STEP becomes NaN; kill-in-save: SIGKILL
after writing the checkpoint taken after STEP, before it is committed; raise-in-save: a
write that fails there (a full disk, say); slow-save: a write that takes 2 s more there.
STEP counts from 1, as in the log; RANK defaults to every rank. Only on a job's first
attempt, so an elastic restart runs clean.

TrainLog runs Faults as a step hook when TRAIN_FAULT is set; the checkpointer calls
strike("save", step) before it commits.
"""

import os
import signal
import sys
import time

import common

# Where each kind strikes.
PLACES = {"kill": "step", "hang": "step", "raise": "step", "nan": "loss", "kill-in-save": "save", "raise-in-save": "save", "slow-save": "save"}


def strike(where, step):
    """Carry out TRAIN_FAULT if it names this place, step and rank; True if it did and returned."""
    spec = os.environ.get("TRAIN_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    kind, at, *rank = spec.split(":")
    if PLACES.get(kind) != where or int(at) != step or (rank and int(rank[0]) != common.RANK):
        return False
    print(f"fault injection: {kind} on rank {common.RANK} at step {step}", file=sys.stderr, flush=True)
    if kind in ("kill", "kill-in-save"):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind in ("raise", "raise-in-save"):
        raise RuntimeError(f"fault injection: an uncaught error at step {step}")
    if kind == "slow-save":
        time.sleep(2)
    if kind == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a hung peer still dies when torchrun ends the job
        while True:
            time.sleep(60)
    return True


class Faults(common.StepHook):
    """The step and loss faults, struck before the ranks agree on the step's loss."""

    def before_agreement(self, step, loss):
        strike("step", step)
        return loss * float("nan") if strike("loss", step) else loss
