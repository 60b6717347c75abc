"""--profile DIR: a torch.profiler trace of 3 steps after the timing warm-up.

One Chrome trace per rank (trace_rank<R>.json: Perfetto and chrome://tracing open it),
and the op table the article reads its figures from, heaviest first by time on the
device (CUDA), by self CPU time on a CPU: printed on rank 0, written by every rank beside
its trace (ops_rank<R>.txt). TrainLog runs the Profiler as a step hook and leaves the
steps it slows out of throughput.
"""

import os
import re
import time

import torch

import common


def check_args(args, cfg):
    common.check(args.steps >= args.timing_warmup_steps + 4, f"--profile traces 3 steps after --timing-warmup-steps "
                 f"{args.timing_warmup_steps} and one more: it needs --steps of at least {args.timing_warmup_steps + 4}")
    common.check_folder("--profile", args.profile)
    # What the ranks write there: a FIFO in its place would wait for a reader forever, a
    # device swallow it. (A folder in its place fails the write itself, in one line.)
    for name in os.listdir(args.profile):
        path = os.path.join(args.profile, name)
        common.check(not re.fullmatch(r"trace_rank\d+\.json|ops_rank\d+\.txt", name) or os.path.isfile(path) or os.path.isdir(path),
                     f"--profile: {path} is not a regular file")


class Profiler(common.StepHook):
    untimed_steps = 5  # its warm-up, the 3 traced steps, and the one its trace's export lands in

    def __init__(self, args, env):
        self.folder, self.rank, self.error = args.profile, env.rank, None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if env.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.sort_by = "self_device_time_total" if env.device.type == "cuda" else "self_cpu_time_total"
        schedule = torch.profiler.schedule(wait=args.timing_warmup_steps, warmup=1, active=3, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._write)
        self.prof.start()

    def _write(self, prof):
        # The profiler reports an error here only as a log line, and its exporter one of
        # moving the trace into place not even that: check the trace, keep what failed.
        trace = os.path.join(self.folder, f"trace_rank{self.rank}.json")
        try:
            started = time.time()
            prof.export_chrome_trace(trace)
            if not os.path.isfile(trace) or os.path.getmtime(trace) < started - 1:
                raise OSError(f"{trace} was not written")
            table = prof.key_averages().table(sort_by=self.sort_by, row_limit=25)
            with open(os.path.join(self.folder, f"ops_rank{self.rank}.txt"), "w") as f:
                f.write(table + "\n")
        except OSError as e:
            self.error = e
            return
        common.log(table)

    def after_step(self, step, metrics, stop):
        self.prof.step()
        self._raise_if_unwritten()

    def results(self):
        self.prof.stop()
        self._raise_if_unwritten()
        return {}

    def _raise_if_unwritten(self):
        if self.error is not None:
            raise common.OutputError(f"--profile {self.folder}: the trace cannot be written ({self.error.strerror or self.error})")
