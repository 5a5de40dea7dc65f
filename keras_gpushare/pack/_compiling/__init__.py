"""`ModelPack`'s compiling backroom: what `compile` makes of its arguments, and the build.

Its modules, each read by `model.py` through the names below:

- `_compile_args`: each member's `compile` arguments from the pack's or its own.
- `_compile_policy`, `_jit_policy`: batches per compiled call and XLA, from the engines.
- `_optimizer_choice`, `_optimizers`: the optimizer Keras sees, and the graph engine as the
  fallback for optimizers with no vectorized form.
- `_member_loss`: each member's loss in the step, scaled per member (mixed precision).
- `_building`: the members, their loss and metric state and the optimizers, from one batch.
- `_saving`: the pack's config and compile config in a `.keras` file, and back; and
  `chief_path` (of `pack/_chief.py`, which the loop reads too): where a worker writes the
  pack's files under several workers.

It never imports `model.py`, nor the member backroom (`_member_access`); it may read the
loop backroom (`_loop`), never the reverse.
"""

from keras_gpushare.pack._chief import chief_path
from keras_gpushare.pack._compiling._building import (
    build_from_batch,
    build_optimizers,
    first_batch,
    gradient_variables,
)
from keras_gpushare.pack._compiling._compile_args import member_args
from keras_gpushare.pack._compiling._compile_policy import (
    distributed,
    jit_compile,
    steps_per_execution,
)
from keras_gpushare.pack._compiling._jit_policy import JitPolicy
from keras_gpushare.pack._compiling._member_loss import (
    attach_loss_scale,
    loss_scales,
    summed_loss,
)
from keras_gpushare.pack._compiling._optimizer_choice import graph_fallback, pack_optimizer
from keras_gpushare.pack._compiling._saving import (
    check_saveable,
    compile_arguments,
    init_arguments,
    pack_config,
)

__all__ = [
    "JitPolicy",
    "attach_loss_scale",
    "build_from_batch",
    "build_optimizers",
    "check_saveable",
    "chief_path",
    "compile_arguments",
    "distributed",
    "first_batch",
    "gradient_variables",
    "graph_fallback",
    "init_arguments",
    "jit_compile",
    "loss_scales",
    "member_args",
    "pack_config",
    "pack_optimizer",
    "steps_per_execution",
    "summed_loss",
]
