"""The reporting maths as plain functions, at world sizes above one, with a given device
peak and made-up timings: no GPU is needed to check what every GPU run reports."""

import time
from types import SimpleNamespace

import pytest
import torch

import common
import ddp_train
import pipeline_train
from options.profile import Profiler


def train_log(world_size=1, peak=None, flops_per_step=0.0, timing_warmup_steps=0, start_step=0, steps=10, counted_step=None, profile=None):
    """A TrainLog's state without a process group: its methods are plain functions of it."""
    return SimpleNamespace(env=SimpleNamespace(world_size=world_size), peak=peak, flops_per_step=flops_per_step,
                           args=SimpleNamespace(timing_warmup_steps=timing_warmup_steps, steps=steps, global_batch_size=64),
                           start_step=start_step, counted_step=counted_step, untimed_steps=Profiler.untimed_steps if profile else 0)


def test_mfu_divides_by_every_device_of_the_world():
    # 8 devices of 100 TFLOP/s for 1 s: 800 TFLOP possible; 200 done is 25%.
    assert common.mfu_pct(200e12, 1.0, 100, 8) == pytest.approx(25.0)
    log = train_log(world_size=8, peak=100, flops_per_step=200e12)
    assert common.TrainLog._mfu(log, 1.0) == pytest.approx(25.0)
    assert common.TrainLog._mfu(train_log(world_size=8, peak=None), 1.0) is None  # no peak known (CPU): no figure


def test_throughput_leaves_out_warmup_and_the_counted_step():
    times = [9.0, 1.0, 1.0, 1.0, 5.0]  # a slow first step, and the last one slowed by the CommCounter
    log = train_log(timing_warmup_steps=1, steps=5, counted_step=5)
    assert common.TrainLog.timed(log, times) == [1.0, 1.0, 1.0]
    samples_per_sec, seconds = common.TrainLog.throughput(SimpleNamespace(**vars(log), step_times=times,
                                                                          timed=lambda t: common.TrainLog.timed(log, t)))
    assert seconds == pytest.approx(1.0) and samples_per_sec == pytest.approx(64.0)
    # A resumed run that stopped early (SIGTERM) counted nothing: every step after warm-up counts.
    assert common.TrainLog.timed(train_log(timing_warmup_steps=1, start_step=2, steps=10), times) == times[1:]
    # --profile's warm-up, 3 traced steps and the one its trace's export lands in are not the run's speed.
    assert common.TrainLog.timed(train_log(timing_warmup_steps=1, steps=8, counted_step=8, profile="dir"), list(range(8))) == [6]
    # Never nothing: one step is still a measurement.
    assert common.TrainLog.timed(train_log(timing_warmup_steps=3, steps=1, counted_step=1), [2.0]) == [2.0]


def test_exposed_communication_and_bus_bandwidth():
    # A step of 1.0 s with the all-reduce, 0.75 s without it: a quarter of it was communication.
    assert ddp_train.exposed_comm_pct(synced_seconds=1.0, compute_seconds=0.75) == pytest.approx(25.0)
    assert ddp_train.exposed_comm_pct(synced_seconds=1.0, compute_seconds=1.02) == 0.0  # noise, not negative
    # nccl-tests: a ring all-reduce of S bytes moves 2(n-1)/n S per rank; 8 ranks, 1 GB in 17.5 ms is 100 GB/s.
    assert ddp_train.allreduce_busbw_gbps(1e9, 8, 0.0175) == pytest.approx(100.0)


@pytest.mark.parametrize("schedule,p,m,v,expected", [
    ("gpipe", 4, 4, 1, 3 / 7), ("1f1b", 4, 8, 1, 3 / 11), ("1f1b", 2, 2, 1, 1 / 3),
    ("interleaved-1f1b", 4, 4, 2, 3 / 11),  # (p-1)/(v·m+p-1): interleaving shrinks it
    ("zero-bubble", 4, 4, 2, None), ("zbv", 4, 4, 2, None),
])
def test_theoretical_bubble_of_every_schedule(schedule, p, m, v, expected):
    got = pipeline_train.theoretical_bubble_pct(schedule, p, m, v)
    assert got is None if expected is None else got == pytest.approx(100 * expected)


def test_busy_time_counts_forward_backward_weight_gradients_and_the_optimizer():
    worked = []  # the seconds each action really slept: under load a sleep overshoots

    def work(seconds):
        start = time.perf_counter()
        time.sleep(seconds)
        worked.append(time.perf_counter() - start)

    class Stage:
        stage_index = 0

        def forward_one_chunk(self, chunk, *args):
            work(0.02)

        def backward_one_chunk(self, chunk, full_backward=True):
            work(0.03)

        def backward_weight_one_chunk(self, chunk):
            work(0.01)

    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    optimizer = torch.optim.SGD([param], lr=0.1)
    stage = Stage()
    clock = common.StepClock(torch.device("cpu"), optimizer)
    optimizer.register_step_pre_hook(lambda *_: work(0.01))  # after the clock's own: inside its timing
    pipeline_train.time_stages([stage], clock)
    clock.begin()
    start = time.perf_counter()
    stage.forward_one_chunk(0, ())
    stage.backward_one_chunk(0, full_backward=False)
    stage.backward_weight_one_chunk(0)
    optimizer.step()
    time.sleep(0.06)  # the bubble: waiting on a peer
    step = time.perf_counter() - start
    clock.end(step)
    assert clock.last_actions == ["F0:0", "I0:0", "W0:0"]
    busy = clock.busy_pct(lambda per_step: per_step)
    # All four actions, and nothing of the bubble (about 50% of the step with no load).
    assert busy == pytest.approx(100 * sum(worked) / step, abs=1.5), (busy, worked, step)


def test_peak_memory_is_a_share_of_the_device():
    gib, pct = common.peak_memory(torch.device("cpu"))
    total = common.os.sysconf("SC_PAGE_SIZE") * common.os.sysconf("SC_PHYS_PAGES")
    assert gib > 0 and pct == pytest.approx(100 * gib * 2**30 / total)
