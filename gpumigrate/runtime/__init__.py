"""Helpers that scripts rewritten by gpumigrate import. A public API: keep names stable.

Depends on torch only. Importing this module has no side effects and no cost beyond torch;
the only communication per training step is the gradient averaging data parallelism needs
(DDP's for `wrap_model` models, FSDP's for `shard_model` models, `setup_distributed`'s for the
others: see averaging.py).
"""

from gpumigrate.runtime.averaging import average_gradients
from gpumigrate.runtime.batches import next_step, shard_batches
from gpumigrate.runtime.device import (accelerator_available, distributed_backend, get_device, get_local_rank,
                                       synchronize, tensor_type)
from gpumigrate.runtime.distributed import (
    barrier,
    broadcast_object,
    cleanup_distributed,
    distributed_sampler,
    get_rank,
    get_world_size,
    is_main_process,
    join_ranks,
    muted_writer,
    progress_stream,
    reduce_mean,
    reduce_sum,
    set_epoch,
    setup_distributed,
    shard_length,
    shard_loader,
    shard_rows,
    unwrap_model,
    without_module_prefix,
    wrap_model,
)
from gpumigrate.runtime.precision import (
    amp_dtype,
    autocast,
    grad_scaler,
    keep_batchnorm_fp32,
    load_scaler_state,
    optimizer_params,
)
from gpumigrate.runtime.seeding import rank_seed
from gpumigrate.runtime.sharding import (
    full_model,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    shard_model,
)

__all__ = [
    "accelerator_available",
    "amp_dtype",
    "autocast",
    "average_gradients",
    "barrier",
    "broadcast_object",
    "cleanup_distributed",
    "distributed_backend",
    "distributed_sampler",
    "full_model",
    "full_optimizer_state_dict",
    "full_state_dict",
    "get_device",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "grad_scaler",
    "is_main_process",
    "join_ranks",
    "keep_batchnorm_fp32",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "load_scaler_state",
    "muted_writer",
    "next_step",
    "optimizer_params",
    "progress_stream",
    "rank_seed",
    "reduce_mean",
    "reduce_sum",
    "set_epoch",
    "setup_distributed",
    "shard_batches",
    "shard_length",
    "shard_loader",
    "shard_model",
    "shard_rows",
    "synchronize",
    "tensor_type",
    "unwrap_model",
    "without_module_prefix",
    "wrap_model",
]
