"""--tensorboard DIR: every step's loss, gradient norm, learning rate, step time, tokens/s,
MFU (where a peak is known) and peak memory, for TensorBoard, from rank 0.

TrainLog runs the Writer as a step hook on rank 0; `tensorboard --logdir DIR` shows it.
"""

from torch.utils.tensorboard import SummaryWriter

import common

TAGS = ("loss", "grad_norm", "lr", "step_seconds", "tokens_per_sec", "mfu_pct", "peak_mem_gib")


def check_args(args, cfg):
    common.check_folder("--tensorboard", args.tensorboard)


class Writer(common.StepHook):
    def __init__(self, args):
        self.writer = SummaryWriter(args.tensorboard)

    def after_step(self, step, metrics, stop):
        """Every step, whatever --log-every says."""
        for tag in TAGS:
            if metrics[tag] is not None:
                self.writer.add_scalar(tag, metrics[tag], step)

    def results(self):
        self.writer.close()
        return {}
