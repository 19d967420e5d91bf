"""The ranks of a job: process groups (:mod:`dvla.distributed.groups`: set-up, teardown and the
small collectives every application uses) and FSDP2-sharded learners
(:mod:`dvla.distributed.sharding`)."""

from dvla.distributed.groups import (
    GRAD_BUCKET_BYTES,
    all_gather_json,
    allreduce_mean_grads,
    broadcast_json,
    broadcast_tensors,
    default_backend,
    init_from_env,
    mean_over_group,
    resolve_device,
    select_interfaces,
    shutdown,
    sum_over_group,
    tensor_layout,
    uses_nccl,
)

__all__ = ["GRAD_BUCKET_BYTES", "all_gather_json", "allreduce_mean_grads", "broadcast_json", "broadcast_tensors",
           "default_backend", "init_from_env", "mean_over_group", "resolve_device", "select_interfaces", "shutdown",
           "sum_over_group", "tensor_layout", "uses_nccl"]
