"""DDP's gradient buckets across a disk restart (design open question 4).

DDP all-reduces gradients bucket by bucket. In torch 2.13 its *first* iteration puts every
parameter in one bucket (`_BucketConfig.compute_bucket_size_limits`: "When static_graph or not
finding unused params, disable initial bucketing"); at the start of the second it rebuilds the
buckets from the order the gradients arrived in (`Reducer::rebuild_buckets`, rank 0's order
broadcast to all). Gloo's and NCCL's all-reduce split a bucket into chunks per rank, so the order
in which the ranks' values are summed depends on where an element sits in its bucket: with 3 or
more ranks a different layout changes the last bits (with 2, a+b == b+a). A job restarted from
disk starts over with the one-bucket layout while the uninterrupted run used the rebuilt one at
that step; measured on CPU with 4 gloo ranks (tests/multirank/test_disk_parts.py), the results
differed in the last bits of the parameters.

So each part records the layout the rebuilt Reducer uses, and the restore builds the Reducer
again with it, the way `DistributedDataParallel._ddp_init_helper` builds it (the same private
constructor arguments, torch 2.13: `make_reducer`, which a multi-rank RAM park uses too,
runtime/ddpreducer.py). That Reducer's own rebuild after its first iteration computes
the same layout again. Where any of this is not possible (no layout recorded yet, a comm hook,
mixed precision, static graph), the restore says so and goes on: the run is still correct, only
not bitwise identical with 3+ ranks.
"""
from __future__ import annotations

from typing import Any


def layout(ddp: Any) -> list[list[int]] | None:
    """The rebuilt bucket assignment of `ddp` (indices into its Reducer's parameter list), or
    None if it has not rebuilt its buckets yet (a checkpoint at the first step)."""
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        return None
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not text:    # logged one sampled iteration late: read the Reducer's buckets instead
        return current(ddp)
    return [[int(i) for i in bucket.split()] for bucket in str(text).split(",")]


def _refusal(ddp: Any) -> str | None:
    if getattr(ddp, "mixed_precision", None) is not None:
        return "mixed precision"
    if getattr(ddp, "static_graph", False):
        return "static_graph=True"
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "delayed all-reduce parameters"
    if getattr(ddp, "_use_python_reducer", False):
        return "the Python reducer"
    if ddp._get_ddp_logging_data().get("comm_hook"):
        return "a communication hook"
    return None


def apply(ddp: Any, indices: list[list[int]]) -> str | None:
    """Give `ddp` a Reducer whose buckets are `indices` from the first iteration on. Call before
    the first forward after a restore. Returns a warning instead when it cannot."""
    why = _refusal(ddp)
    if why is not None:
        return f"DDP uses {why}: its first step after the restore uses DDP's initial buckets"
    params, _ = ddp._build_params_for_reducer()
    flat = [i for bucket in indices for i in bucket]
    if sorted(flat) != list(range(len(params))):
        return (f"the checkpoint's DDP buckets cover {len(flat)} parameters, the model has {len(params)}: "
                "its first step after the restore uses DDP's initial buckets")
    reducer = make_reducer(ddp, indices)
    ddp.reducer._remove_autograd_hooks()     # the old one must not reduce a gradient too
    ddp.reducer = reducer
    give_logger(ddp)
    return None


def current(ddp: Any) -> list[list[int]]:
    """The bucket assignment `ddp`'s Reducer uses now (indices into its parameter list). Reads
    `_get_zeros_like_grad_buckets`, which allocates zeros the size of every bucket for a moment."""
    params = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    return [[params[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def make_reducer(ddp: Any, indices: list[list[int]]) -> Any:
    """A new Reducer for `ddp`'s parameters with the bucket assignment `indices`, built with the
    private constructor arguments `DistributedDataParallel._ddp_init_helper` passes, on
    `ddp.process_group`. Two forms: torch 2.13 (`ddp._bucket_config`) and the one before it
    (torch 2.11, read off its `_ddp_init_helper` on a GPU machine: `bucket_bytes_cap_default`,
    `dist._DEFAULT_FIRST_BUCKET_BYTES`, `bucket_bytes_cap_list`). It registers its own autograd
    hooks; the caller retires the old one."""
    import torch.distributed as dist

    params, expect_sparse = ddp._build_params_for_reducer()
    flat = [i for bucket in indices for i in bucket]
    config = getattr(ddp, "_bucket_config", None)
    name_map = ddp._build_debug_param_to_name_mapping(params)
    if config is None:      # torch before 2.13
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if ddp.bucket_bytes_cap_default else ddp.bucket_bytes_cap
        cap_list = list(getattr(ddp, "bucket_bytes_cap_list", None) or [])
        # The per-bucket limits are only logged by the Reducer; rebuilding uses the caps below.
        return dist.Reducer(
            params, indices, [ddp.bucket_bytes_cap] * len(indices), ddp.process_group, expect_sparse,
            ddp.bucket_bytes_cap, ddp.find_unused_parameters, ddp.gradient_as_bucket_view, name_map, first,
            ddp.skip_all_reduce_unused_params, ddp._use_python_reducer, cap_list)
    caps = [config.first_bucket_bytes_cap, ddp.bucket_bytes_cap]
    got, limits = dist._compute_bucket_assignment_by_size(
        [params[i] for i in flat], caps, [expect_sparse[i] for i in flat], flat)
    if [list(b) for b in got] != indices:
        limits = [ddp.bucket_bytes_cap] * len(indices)     # only logged by the Reducer
    _, rebuild_limits = config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters)
    return dist.Reducer(
        params, indices, list(limits), ddp.process_group, expect_sparse, ddp.bucket_bytes_cap,
        ddp.find_unused_parameters, ddp.gradient_as_bucket_view, name_map, config.first_bucket_bytes_cap,
        ddp.skip_all_reduce_unused_params, ddp._use_python_reducer, rebuild_limits, ddp.batched_grad_copy)


def give_logger(ddp: Any) -> None:
    """A new DDP Logger for `ddp.reducer` with the construction data `_ddp_init_helper` logs (it
    reads the Reducer's process group: call once that group is the one DDP will use)."""
    import torch
    import torch.distributed as dist

    ddp.logger = dist.Logger(ddp.reducer)
    ddp.reducer.set_logger(ddp.logger)
    sync_bn = any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules())
    ddp.logger.set_construction_data_and_log(
        ddp.module.__class__.__name__, [] if ddp.device_ids is None else ddp.device_ids,
        -1 if ddp.output_device is None else ddp.output_device,
        getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)), sync_bn,
        ddp.static_graph)
