"""--checkpoint-dir DIR [--checkpoint-every K]: sharded checkpoints with
torch.distributed.checkpoint (DCP), written behind training, and resume.

common.checkpointer() builds the Checkpointer; a script resumes with its load(), and
TrainLog saves through it after each step (a StepHook).
"""

import logging
import os
import re
import time
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as sd
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

import common
from common import IS_MAIN, ConfigError, check, log


def check_args(args, cfg):
    common.check_folder("--checkpoint-dir", args.checkpoint_dir)


def _plain(value):
    """The high-precision tensor inside torchao's float8 weight wrapper (FSDP's float8
    all-gather), as a view of the same storage: a checkpoint then holds plain tensors
    that a bf16 run loads too, and that load in place into the wrapped weights."""
    if isinstance(value, DTensor) and hasattr(value._local_tensor, "_tensor"):
        return DTensor.from_local(value._local_tensor._tensor, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
    return value._tensor if isinstance(value, torch.Tensor) and hasattr(value, "_tensor") else value


def _load_error(e):
    """What failed in a checkpoint load, in a few words: DCP's own exception gathers
    every rank's, and the first says enough."""
    rank = None
    if hasattr(e, "failures") and e.failures:
        rank, (e, _) = next(iter(e.failures.items()))
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}{'' if rank is None else f' on rank {rank}'}{': ' + text[0][:160] if text else ''}"


class KeptStager(DefaultStager):
    """One host copy of the state, reused by every save and released by us alone: torch
    2.11 closes the copier inside a stager once a save is written, which leaves it unable
    to stage the next (KeyError in its deepcopy)."""

    def __init__(self, options):
        super().__init__(options)
        self._state_dict_stager.close = lambda: None

    def close(self):
        pass

    def release(self):
        del self._state_dict_stager.close  # its class's own close again
        DefaultStager.close(self)


class Checkpointer(common.StepHook):
    """Sharded checkpoints: every rank writes its own part with torch.distributed.checkpoint.

    A checkpoint is written to step_N.partial/ and renamed to step_N/ only after every rank
    has finished, so a crash mid-save leaves the previous checkpoint the newest complete one.
    The last step is always saved, so a finished run started again has nothing to do.
    Resume takes the newest checkpoint that loads: one that does not (a truncated shard,
    garbled metadata) is moved aside to step_N.unreadable, said in one line, and the one
    before it is tried; nothing is ever deleted.

    The folder must be one every rank sees (a shared filesystem); rank 0 decides what is in
    it, so ranks never disagree over a directory listing. `model` must carry global
    parameter names (blocks keyed by global index), so ranks holding different parts never
    write the same name; optimizer state is keyed by those names too, which lets DCP
    reshard to another world size. Step, run and model shape are stored as tensors, but DCP
    reads its metadata with pickle: a checkpoint is trusted input, like code.

    The saves of --checkpoint-every are written behind training (dcp.async_save): training
    stops only while the state is copied to host memory (on a GPU, not even then: the copy
    runs on a side stream, and the next optimizer step waits for it), and a thread of DCP's
    writes it to disk over a gloo group of its own, then commits it. That copy costs host
    memory the size of this rank's state, kept for the next save. The last save, and one
    on SIGTERM, are written at once: the job ends next.
    """

    # What must match for a resume to continue the same run (the data position is step x batch).
    RUN_SHAPE = ("global_batch_size", "seed")
    MODEL_SHAPE = ("n_layers", "n_heads", "d_model", "vocab_size", "max_seq_len")
    # Each rank writes its part as this many files, by as many threads: on the H200 machine's
    # disk 8 threads wrote 6 GiB at 1.79 GB/s where 1 wrote 0.68; 16 gained nothing (1.81).
    WRITE_THREADS = 8

    def __init__(self, args, cfg, model, optimizer, scaler=None):
        self.args, self.cfg, self.dir, self.every = args, cfg, args.checkpoint_dir, args.checkpoint_every
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.options = sd.StateDictOptions(flatten_optimizer_state_dict=True)
        self.save_seconds, self.saves, self.staging_wait = 0.0, 0, 0.0  # what training stood still for, and how often
        self.background = None  # the save being written behind training: done once committed
        if self.every:
            # Its own group: collectives of two threads must not interleave on one.
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
            cuda = any(p.is_cuda for p in model.parameters())
            self.stager = KeptStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda))
            optimizer.register_step_pre_hook(self._wait_for_staging)  # the step would change what is being copied

    def _wait_for_staging(self, *_):
        start = time.perf_counter()
        self.stager.synchronize_staging()
        self.staging_wait += time.perf_counter() - start

    def _extra(self, step):
        extra = {"step": torch.tensor(step), "steps": torch.tensor(self.args.steps)}
        extra |= {k: torch.tensor(getattr(self.args, k)) for k in self.RUN_SHAPE}
        extra |= {f"model.{k}": torch.tensor(getattr(self.cfg, k)) for k in self.MODEL_SHAPE}
        if self.scaler is not None:
            extra |= {f"scaler.{k}": torch.tensor(v) for k, v in self.scaler.state_dict().items()}
        return extra

    def _state(self, step):
        state = {
            "model": sd.get_model_state_dict(self.model),
            "optim": sd.get_optimizer_state_dict(self.model, self.optimizer, options=self.options),
        }
        return torch.utils._pytree.tree_map(_plain, state) | {"extra": self._extra(step)}

    def _on_rank0(self, fn):
        """fn() evaluated on rank 0 and shared with every rank."""
        box = [fn() if IS_MAIN else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _complete(self):
        """The committed checkpoints, newest first."""
        if not os.path.isdir(self.dir):
            return []
        steps = sorted((int(m.group(1)) for d in os.listdir(self.dir) if (m := re.fullmatch(r"step_(\d+)", d))), reverse=True)
        return [os.path.join(self.dir, f"step_{s:08d}") for s in steps]

    def _check_shape(self, path, extra):
        for k in self.MODEL_SHAPE:
            check(int(extra[f"model.{k}"]) == getattr(self.cfg, k), f"{path} holds a model with {k} {int(extra[f'model.{k}'])}, "
                  f"this run's has {getattr(self.cfg, k)} (--model {self.args.model}, --vocab-size): resume with the same, or use another --checkpoint-dir")
        for k in self.RUN_SHAPE:
            check(int(extra[k]) == getattr(self.args, k), f"{path} was trained with --{k.replace('_', '-')} {int(extra[k])}: "
                  f"resume with the same, or use another --checkpoint-dir")

    def load(self):
        """Restore the newest checkpoint that loads; return the step to continue from (0 if none)."""
        set_aside = []
        for path in self._on_rank0(self._complete):
            logging.disable(logging.WARNING)  # DCP logs each failed read with a traceback on the root logger
            try:
                extra = {"extra": {k: torch.zeros_like(v) for k, v in self._extra(0).items()}}
                dcp.load(extra, checkpoint_id=path)  # first only what it is: refuse another model before its tensors
                self._check_shape(path, extra["extra"])
                state = self._state(0)
                dcp.load(state, checkpoint_id=path)  # DCP raises on every rank when any rank's read fails
            except ConfigError:
                raise
            except (Exception, dcp.CheckpointException) as e:  # unreadable (DCP's error is a BaseException): set it aside, try the one before
                aside = self._on_rank0(lambda: self._set_aside(path))
                log(f"skipping {path}: it does not load ({_load_error(e)}); moved to {aside}, trying the one before")
                set_aside.append(aside)
                continue
            finally:
                logging.disable(logging.NOTSET)
            extra = state["extra"]
            sd.set_model_state_dict(self.model, state["model"])
            sd.set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=self.options)
            if self.scaler is not None:
                self.scaler.load_state_dict({k.removeprefix("scaler."): v.item() for k, v in extra.items() if k.startswith("scaler.")})
            step = int(extra["step"])
            log(f"resumed from {path} at step {step}" + ("" if int(extra["steps"]) == self.args.steps else
                f" (it was run for --steps {int(extra['steps'])}: the learning-rate schedule now stretches to {self.args.steps})"))
            if step >= self.args.steps:
                log(f"nothing left to train: --steps {self.args.steps}")
            return step
        # DCP loads in place: a load that failed part-way may have changed the weights.
        check(not set_aside, f"no checkpoint in {self.dir} loads ({', '.join(set_aside)} set aside), and the failed load may have "
                             "changed this run's weights: launch again to train from step 0")
        return 0

    @staticmethod
    def _set_aside(path):
        aside, n = f"{path}.unreadable", 1
        while os.path.exists(aside):
            n += 1
            aside = f"{path}.unreadable-{n}"
        os.rename(path, aside)
        return aside

    def maybe_save(self, step, force=False):
        """Save after `step` optimizer steps if it is due: every --checkpoint-every steps
        (behind training), after the last step, or when forced (SIGTERM)."""
        if self.background is not None and self.background.done():
            self.wait()  # raises here, not steps later, if the background save failed
        ends = force or step == self.args.steps
        if not (ends or (self.every and step % self.every == 0)):
            return
        t0 = time.perf_counter()
        self.wait()  # one save at a time, committed in order
        final = os.path.join(self.dir, f"step_{step:08d}")
        if self._on_rank0(lambda: os.path.isdir(final)):
            return
        if ends:
            dcp.save(self._state(step), storage_writer=self._writer(final))
            self._commit(final, step, dist.group.WORLD)
            if self.every:
                self.stager.release()  # its host copy of the state is not needed again
        else:
            response = dcp.async_save(self._state(step), storage_writer=self._writer(final), process_group=self.group,
                                      async_stager=self.stager)
            if not self.saves:
                # The first staging pins its host copy (cudaHostRegister; 2.5b: 32 GB, ~14 s), which
                # holds the CUDA driver's lock: training's kernel launches would stand still behind
                # it, uncounted. Waiting here counts it; later saves reuse the pinned copy.
                self.stager.synchronize_staging()
            written = getattr(response, "upload_completion", response)  # a Future, or with async staging a pair of them
            self.background = committed = Future()

            def commit(written):
                try:
                    written.result()
                    self._commit(final, step, self.group)
                    log(f"saved {final} (written behind training)")
                    committed.set_result(None)
                except BaseException as e:  # DCP's CheckpointException is one
                    committed.set_exception(e)

            written.add_done_callback(commit)  # in DCP's thread, once this rank's part is on disk
        seconds = time.perf_counter() - t0
        self.save_seconds += seconds
        self.saves += 1
        log(f"saved {final} in {seconds:.1f} s" if ends else f"saving {final} behind training (it stood still {seconds:.2f} s)")

    def _writer(self, final):
        return dcp.FileSystemWriter(final + ".partial", thread_count=self.WRITE_THREADS)

    def _commit(self, final, step, group):
        if "TRAIN_FAULT" in os.environ:  # the tests' fault points
            common.option("faults").strike("save", step)
        dist.barrier(group=group)  # every rank's part is on disk
        if IS_MAIN:
            os.rename(final + ".partial", final)  # the commit: from now on resume sees it
        dist.barrier(group=group)

    def wait(self):
        """Until the save being written behind training, if any, is committed; raises if it failed."""
        if self.background is not None:
            background, self.background = self.background, None
            background.result()

    def after_step(self, step, metrics, stop):
        self.maybe_save(step, force=stop)

    def results(self):
        """What training stood still for checkpoints: saves (outside the steps' time), and
        steps waiting for a copy behind training (inside it)."""
        return {"checkpoints_saved": self.saves, "checkpoint_stall_seconds": self.save_seconds + self.staging_wait}
