"""--count-comm: count what the last optimizer step hands the process group, every
collective and transfer, by kind, group, dtype and bytes: the results line's
comm_per_step. --simulate turns it on (a simulated rank's communication is counted, not
sent); run_all.sh turns it on for every row (its report draws the bytes).

TrainLog runs the CommCounter as a step hook, on the last step, which it leaves out of
throughput.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

import common

# op -> (kind, which argument holds the collective's whole buffer). The buffer is
# nccl-tests' "size": an all-reduce's tensor, an all-gather's output, a reduce-scatter's
# input, one message of a send or receive; ring factors turn it into time on the wire.
# c10d ops carry their process group; functional collectives (DTensor's) its name.
_COLLECTIVES = {
    "c10d.allreduce_": ("all_reduce", 0), "c10d.allreduce_coalesced_": ("all_reduce", 0),
    "c10d.allgather_": ("all_gather", 0), "c10d._allgather_base_": ("all_gather", 0),
    "c10d.allgather_coalesced_": ("all_gather", 0), "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d.reduce_scatter_": ("reduce_scatter", 1), "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.broadcast_": ("broadcast", 0), "c10d.reduce_": ("reduce", 0),
    "c10d.alltoall_": ("all_to_all", 1), "c10d.alltoall_base_": ("all_to_all", 1),
    "c10d.send": ("send", 0), "c10d.recv_": ("recv", 0), "c10d.recv_any_source_": ("recv", 0),
    "_c10d_functional.all_reduce": ("all_reduce", 0), "_c10d_functional.all_reduce_": ("all_reduce", 0),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0), "_c10d_functional.all_gather_into_tensor_out": ("all_gather", 0),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0),
    "_c10d_functional.broadcast": ("broadcast", 0), "_c10d_functional.broadcast_": ("broadcast", 0),
}


def _tensors(x):
    if is_traceable_wrapper_subclass(x):  # float8's tensors: count what travels, the float8 data and its scale
        return [t for name in x.__tensor_flatten__()[0] for t in _tensors(getattr(x, name))]
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _tensors(item)] if isinstance(x, (list, tuple)) else []


def _group_ranks(func_name, args):
    """The global ranks of the group a collective runs in."""
    if func_name.startswith("_c10d_functional."):
        name = args[-1]
    else:
        name = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject))).group_name
    return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))


class _Counting(TorchDispatchMode):
    """Sees every op at the dispatcher, as torch's CommDebugMode does (which counts calls,
    not bytes or groups), so DDP's reducer, FSDP's hooks, DTensor's redistributions and the
    pipeline's sends are all counted as they really run, not as a formula says they should."""

    def __init__(self, totals):
        super().__init__()
        self.totals = totals

    @classmethod
    def ignore_compile_internals(cls):
        """Compiled blocks run compiled under it, their collectives still seen. A plain mode
        makes dynamo skip a frame for good (pytorch#190286): a block first called under it
        would never compile, and one called under it once would run eager from then on."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
            return NotImplemented  # let DTensor turn itself into the collectives it needs
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in _COLLECTIVES:
            self.add(name, args)
        return out

    def add(self, name, args):
        kind, buffer_arg = _COLLECTIVES[name]
        tensors = _tensors(args[buffer_arg])
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if name.startswith("_c10d_functional.all_gather"):
            nbytes *= args[1]  # given the shard: the gathered buffer is group_size shards
        key = (kind, _group_ranks(name, args), str(tensors[0].dtype).removeprefix("torch.") if tensors else "none")
        calls, total = self.totals.get(key, (0, 0))
        self.totals[key] = (calls + 1, total + nbytes)


class CommCounter(common.StepHook):
    """Counts the last step, from its start until its loss is agreed on (that all-reduce is
    the step log's, not the strategy's). Costly per op outside compiled code: one step
    only, left out of throughput."""

    slows_last_step = True

    def __init__(self, args):
        self.last, self.totals, self.counted = args.steps, {}, False
        self.mode = _Counting(self.totals)

    def before_step(self, step):
        if step == self.last:
            self.mode.__enter__()

    def before_agreement(self, step, loss):
        if step == self.last:
            self.mode.__exit__(None, None, None)
            self.counted = True
        return loss

    def results(self):
        """One entry per (kind, group, dtype); none if the last step was never reached (SIGTERM)."""
        if not self.counted:
            return {}
        return {"comm_per_step": [{"kind": k, "group": list(g), "group_size": len(g), "dtype": d, "calls": c, "bytes": b}
                                  for (k, g, d), (c, b) in sorted(self.totals.items())]}
