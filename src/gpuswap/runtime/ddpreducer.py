"""DDP's Reducer across a multi-rank RAM park: its bucket buffers freed, a new Reducer made.

With DDP's default `gradient_as_bucket_view=False` the C++ Reducer keeps one flat buffer per
bucket (`Reducer::Bucket::gradients`, torch/csrc/distributed/c10d/reducer.hpp), about one more
copy of the gradients, which Python cannot reach: no binding hands them out except to a
communication hook during backward (`_get_zeros_like_grad_buckets` returns zeros *like* them).
Nothing frees them but the Reducer's destruction. So at a RAM park, once the attached tensors
are released, each rank drops every DDP's Reducer (and the Logger, which holds it) and at unpark
builds a new one with the very bucket assignment the old one had (`ddpbuckets.make_reducer`, the
constructor call of `DistributedDataParallel._ddp_init_helper`): its buffers are allocated there,
with the rest of the job's memory, so a rank that cannot get them back fails its unpark and the
job stays parked. At regroup the new Reducer gets the new group (`_update_process_group`), its
Logger, and the communication hook the script registered (Python hooks from `ddp._comm_hooks`,
a built-in one by the name DDP logged for it).

Why the run goes on bitwise: the regroup's `_update_process_group` always reset the old Reducer
(`Reducer::reset_state`: buckets to be rebuilt from the next backward's order, that order
cleared, the division factor unset, the unused-parameter map zeroed); a new Reducer starts in
that same state with the same buckets. A bucket's contents never carry over from one backward to
the next: every element is written (a gradient copied in, or zeros for a parameter without one,
`Reducer::mark_variable_ready_dense`) before the bucket is reduced. The parameters' AccumulateGrad
nodes are kept alive across the swap, so the new Reducer hooks the same nodes and hooks a script
put on them stay. Tested on CPU (gloo): tests/multirank/test_mr_ram.py, tests/runtime/test_rt_ddpreducer.py.

What keeps its Reducer, and so its buffers on the GPU while parked (`keeps` says why):
`gradient_as_bucket_view=True` (the buckets are the gradients: parked with them), `static_graph`
(a new Reducer would learn the graph again: its first iteration reduces differently), mixed
precision, delayed all-reduce parameters, the Python reducer (torch.compile), an optimizer run in
backward, parameters with sparse gradients, and a hook DDP did not record. Each is the runtime's
choice not to rebuild what it has not proved; the simulated GPU counts those buffers as staying.

torch internals relied on (2.13; each is private and may change): `ddp.reducer`, `ddp.logger`,
`ddp._comm_hooks`, `Reducer._get_zeros_like_grad_buckets`, `Reducer._remove_autograd_hooks`,
`dist.Reducer(...)`/`dist.Logger` with `_ddp_init_helper`'s arguments, `dist._register_comm_hook`,
`dist._register_builtin_comm_hook`, `DistributedDataParallel._build_params_for_reducer`, and
`_get_ddp_logging_data()["comm_hook"]`. On NCCL the Reducer made at unpark sits on a placeholder
group until the regroup (runtime/regroup.py); seen with one NCCL rank on an H100
(tests/multirank/test_nccl_one_gpu.py), unverified with two or more.
"""
from __future__ import annotations

import gc
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from gpuswap.runtime import ddpbuckets

BUILTIN_PREFIX = "BuiltinCommHookType."     # how DDP logs a built-in hook's name (str of the enum)


def keeps(ddp: Any) -> Optional[str]:
    """Why `ddp`'s Reducer stays across a park (None: it is dropped and made again)."""
    if getattr(ddp, "reducer", None) is None:
        return "no Reducer (every parameter's all-reduce is delayed)"
    if ddp.gradient_as_bucket_view:
        return "gradient_as_bucket_view=True: its buckets are the gradients, parked with them"
    if ddp.static_graph:
        return "static_graph=True: a new Reducer would learn the graph again"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "mixed precision"
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "delayed all-reduce parameters"
    if getattr(ddp, "_use_python_reducer", False):
        return "the Python reducer"
    params, sparse = ddp._build_params_for_reducer()
    if any(sparse):
        return "parameters with sparse gradients"
    if any(hasattr(p, "_in_backward_optimizers") for p in params):
        return "an optimizer in backward"
    name = _hook_name(ddp)
    if name and not ddp._comm_hooks and _builtin(name) is None:
        return f"a communication hook DDP did not record ({name})"
    return None


def builtin_hook_kept(ddp: Any) -> bool:
    """A built-in communication hook holds the group it was registered with in C++; only a new
    Reducer (with the hook registered again on the new group) lets go of it."""
    return getattr(ddp, "reducer", None) is not None and _builtin(_hook_name(ddp)) is not None \
        and not ddp._comm_hooks and keeps(ddp) is not None


def held_bytes(ddp: Any) -> int:
    """Device bytes of `ddp`'s bucket buffers that are not the gradients themselves (0 without a
    Reducer, or with `gradient_as_bucket_view=True`). From the parameters: a bucket is as large as
    its parameters, in their dtype (mixed precision: the reduced one); sparse ones have none."""
    if not hasattr(ddp, "reducer") or ddp.gradient_as_bucket_view:     # no attribute: no Reducer ever
        return 0
    import torch

    mp = getattr(ddp, "mixed_precision", None)
    size = torch.empty((), dtype=mp.param_dtype).element_size() if mp is not None else None
    params, sparse = ddp._build_params_for_reducer()
    return sum(p.numel() * (size or p.element_size()) for p, s in zip(params, sparse) if not s)


def _hook_name(ddp: Any) -> str:
    logger = getattr(ddp, "logger", None)
    return str(logger._get_ddp_logging_data().strs_map.get("comm_hook", "")) if logger is not None else ""


def _builtin(name: str) -> Any:
    import torch.distributed as dist

    if not name.startswith(BUILTIN_PREFIX):
        return None
    return getattr(dist.BuiltinCommHookType, name[len(BUILTIN_PREFIX):], None)


@dataclass
class _Dropped:
    """What a dropped Reducer leaves behind to make its successor from."""

    ddp: Any                        # weakref.ref to the DistributedDataParallel
    layout: list[list[int]]
    hook_name: str                  # as DDP logged it ("" without a hook)
    join: bool                      # DDP logged join_uneven_inputs
    nodes: list[Any] = field(default_factory=list)   # the parameters' AccumulateGrad nodes


class Reducers:
    """One rank's DDP Reducers across RAM parks. Training thread only."""

    def __init__(self) -> None:
        self._dropped: dict[int, _Dropped] = {}
        self.kept: dict[int, str] = {}             # id(ddp) -> why its Reducer stayed at the last park
        self._bytes: dict[int, tuple[Any, int]] = {}  # id(ddp) -> (weakref, held_bytes): the params never change

    def drop(self, ddps: Iterable[Any]) -> int:
        """At the park, after the attached tensors were released: retire each DDP's Reducer
        (its buffers go with it) unless `keeps` says why not. Returns the buffer bytes freed."""
        freed, told = 0, set(self.kept.values())
        self.kept = {}
        for ddp in ddps:
            rec = self._dropped.get(id(ddp))
            if rec is None or rec.ddp() is not ddp:     # (an id reused by a new object)
                why = keeps(ddp)
                if why is not None:
                    self.kept[id(ddp)] = why
                    if why not in told and self.bytes_of(ddp):     # buffers that are not the grads
                        print(f"gpuswap: DDP's bucket buffers stay on the GPU while parked: {why}",
                              file=sys.stderr, flush=True)
                    continue
                rec = _Dropped(weakref.ref(ddp), ddpbuckets.current(ddp), _hook_name(ddp),
                               bool(ddp._get_ddp_logging_data().get("join_uneven_inputs")))
                self._dropped[id(ddp)] = rec
            if ddp.reducer is None:
                continue
            freed += self.bytes_of(ddp)
            if not rec.nodes:
                from torch.autograd.graph import get_gradient_edge

                rec.nodes = [get_gradient_edge(p).node for p in ddp._build_params_for_reducer()[0]]
            ddp.reducer._remove_autograd_hooks()
            ddp.reducer = ddp.logger = None
        if freed:
            gc.collect()    # a cycle may hold a hook's future, whose value is a bucket buffer
        return freed

    def build(self) -> None:
        """At unpark, with the parameters back: a new Reducer (and its buffers) for every DDP
        whose Reducer was dropped. On failure (the memory is not there) the caller's release
        drops what was made again."""
        for key, rec in list(self._dropped.items()):
            ddp = rec.ddp()
            if ddp is None:
                del self._dropped[key]      # the script let it go while parked
            elif ddp.reducer is None:
                ddp.reducer = ddpbuckets.make_reducer(ddp, rec.layout)

    def finish(self, ddp: Any) -> None:
        """At regroup, once `ddp._update_process_group` pointed the new Reducer at the new group:
        its Logger and its communication hook, as DDP gave them to the old one."""
        import torch.distributed as dist

        rec = self._dropped.pop(id(ddp), None)
        if rec is None or rec.ddp() is not ddp:
            return
        if ddp.reducer is None:     # not made at unpark (never the case when every unpark worked)
            ddp.reducer = ddpbuckets.make_reducer(ddp, rec.layout)    # on ddp.process_group: the new one
        ddpbuckets.give_logger(ddp)
        if rec.join:
            ddp.logger._set_uneven_input_join()
        for hook, state in ddp._comm_hooks:
            dist._register_comm_hook(ddp.reducer, state, hook)
        builtin = _builtin(rec.hook_name) if not ddp._comm_hooks else None
        if builtin is not None:
            dist._register_builtin_comm_hook(ddp.reducer, builtin)   # on the new group
        if rec.hook_name:
            ddp.logger._set_comm_hook_name(rec.hook_name)

    def bytes_of(self, ddp: Any) -> int:
        entry = self._bytes.get(id(ddp))
        if entry is None or entry[0]() is not ddp:
            entry = (weakref.ref(ddp), held_bytes(ddp))
            self._bytes[id(ddp)] = entry
        return entry[1]

    def held(self, ddps: Iterable[Any]) -> int:
        """Buffer bytes the Reducers of `ddps` hold now (the simulated GPU counts them)."""
        return sum(self.bytes_of(d) for d in ddps if getattr(d, "reducer", None) is not None)
