"""--float8 {tensorwise,rowwise}: every block's linear runs its matmuls in float8 through
torchao, with a scale per tensor (tensorwise) or per row (rowwise) from each input's amax.
Weights, gradients and optimizer state stay in high precision, so checkpoints are those
of a bf16 run. The head stays in --dtype: the loss reads its logits.

common.build_model calls convert(), common.make_optimizer scales_after_each_step().
"""

from dataclasses import replace

import torch
import torch.nn as nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

import common


def convert(model, args, device, fsdp):
    """Swap the blocks' linears for torchao's Float8Linear. fsdp: the caller shards the model
    with fully_shard next, which then all-gathers tensorwise weights already in float8."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        common.check(capability >= (8, 9), f"--float8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                                           f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    config = Float8LinearConfig.from_recipe_name(args.float8)
    if fsdp and args.float8 == "tensorwise":
        # Half the bytes of a bf16 gather; per-row scales cannot be gathered that way.
        config = replace(config, enable_fsdp_float8_all_gather=True)
    # float8 kernels need both dimensions divisible by 16.
    kept = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and
            (name == "head" or m.in_features % 16 or m.out_features % 16)]
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name not in kept)
    n = sum(isinstance(m, Float8Linear) for m in model.modules())
    common.log_once(f"float8 {args.float8}: {n} linears converted; kept in {args.dtype}: {', '.join(kept) or 'none'}"
                    f"{'; weights all-gathered in float8' if config.enable_fsdp_float8_all_gather else ''}")
    if device.type == "cuda" and not args.compile:
        common.log_once("note: --float8 without --compile is slower than bf16 (its casts and scales run as separate kernels): add --compile")


def scales_after_each_step(optimizer, model):
    """Where FSDP gathers float8 weights: every weight's scale for the coming step in one
    all-reduce of their amaxes (not one per weight and gather), computed before the first
    block runs after the weights changed: after an optimizer step, or a checkpoint's load
    (which steps the optimizer once itself, on the old weights, to make its state)."""
    if not any(isinstance(m, Float8Linear) and isinstance(getattr(m.weight, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
               for m in model.modules()):
        return
    stale = [True]

    def precompute(*_):
        if stale[0]:
            precompute_float8_dynamic_scale_for_fsdp(model)
            stale[0] = False

    optimizer.register_step_post_hook(lambda *_: stale.__setitem__(0, True))
    for block in model.blocks.values():  # before FSDP's own hook gathers the block
        block.register_forward_pre_hook(precompute, prepend=True)
