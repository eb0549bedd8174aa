"""A torchrun worker for the multi-rank tests under a real daemon (tests/multirank/test_mr_*.py):
small data-parallel trainings (gloo, CPU) with the two gpuswap lines, run under a real daemon and,
as the reference, under plain torchrun.

    torchrun --nproc-per-node N mr_job.py --steps S --out DIR [--modes ddp,zero,fsdp2]
             [--gate FILE --hold-at H[,H2...]] [--no-attach RANK] [--hang-in-park RANK]
             [--block-rank R --block-file F] [--fail-dir DIR] [--probe-buckets] [--report-each-step]

--modes: which trainings run, side by side in one process, one step of each per loop step
(starting torchrun is most of a test's cost): `ddp` (DistributedDataParallel + AdamW), `zero`
(DDP + ZeroRedundancyOptimizer over AdamW), `fsdp2` (fully_shard on every Linear and the root,
AdamW over the DTensor parameters). All are attached; one pause parks them all, and the rank's
regroup rebinds every one of them.
--gate: at step H (each of them) the ranks keep calling `safepoint(H)` until FILE or FILE.H exists,
so the test can pause and resume the job as often as it likes before it goes on (several holds:
a job restarted from a disk checkpoint goes on to the next one). Whether the gate is open is decided
collectively (an all-reduce of each rank's look at the file), so every rank makes the same number
of safepoint calls: ticks stay in step across ranks, as in any SPMD loop. Nothing trains while
held, so the final state equals the reference's, which runs without a gate.
--no-attach: that rank never calls `gpuswap.attach` (a rank that never attaches).
--hang-in-park: test-only hook armed by this script, not a product flag: that rank blocks forever
in its park, after its process group is destroyed (a rank hung mid-park).
--block-rank/--block-file: while held at the gate, once FILE exists, that rank writes FILE.ack and
then blocks outside any safepoint until FILE.go exists (a rank that does not reach the pause's
common step: the test kills it during the agreement).
--fail-dir: a test hook, in this script only: if DIR/part-r<R> exists when rank R writes its part
of a disk checkpoint, the file is removed and the write fails (as a full disk would); if
DIR/manifest exists when rank 0 is about to commit, rank 0 is SIGKILLed (its part is durable, the
manifest is not written); if DIR/slow-r<R> exists (it holds a number of seconds S), rank R's part
is written as a slow disk would: in small pieces, evenly over at least S seconds, every byte on its
way all the time (a part of a large job on a slow filesystem).
--wait-file F: after `attach`, before the first step, every rank waits until F exists (a pause
asked for before any rank reached its first safepoint: the optimizer's state is made by the first
step, after the last measurement the runtime reported).
--probe-buckets: the `ddp` training gets a communication hook that all-reduces like DDP's default
one (in the reference run too, so the results stay comparable) and keeps a weak reference to each
bucket buffer's storage (`StorageWeakRef`, which keeps nothing alive). A test hook armed by this
script then notes, as each `paused` report leaves a rank (its park is complete), whether the
buffers of the last backward still exist: DDP's C++ Reducer holds them, out of the runtime's reach
unless it frees them (runtime/ddpreducer.py).
--report-each-step: every rank sends its usage report (the heartbeat's) right after each step's
safepoint, not in the hold loop: reports that come faster than the supervisor writes status.json,
as a short $GPUSWAP_USAGE_INTERVAL_S sends them (the test sets that one long, so these are all).

Each rank writes, per mode, its parameters, optimizer state, RNG state, data generator and how
many distinct default groups it trained with to DIR/MODE/rank{R}.pt, and leaves with os._exit
after destroying its group (a gloo group's destructor can deadlock at exit: pytorch#56297).
"""
from __future__ import annotations

import argparse
import errno
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.multiprocessing.reductions import StorageWeakRef

import gpuswap
from dist_helpers import full_state, local


class NoJob:
    start_step = 0

    def safepoint(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def build(mode: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(1234)                              # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    if mode == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = nn.parallel.DistributedDataParallel(net)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    raise SystemExit(f"unknown mode {mode}")


class BucketProbe:
    """The state of `probe_hook`: weak references to the bucket buffers of the last backward."""

    def __init__(self) -> None:
        self.refs: list[tuple[Any, int]] = []     # (StorageWeakRef, bytes)
        self.parked: list[list[bool]] = []        # per park: whether each of them was freed


def probe_hook(state, bucket):  # no annotations: DDP checks them, and these would be strings
    """DDP's default reduction as a Python hook (divide by the world size, all-reduce on the
    default group of the moment), noting the bucket's buffer on the way."""
    buf = bucket.buffer()
    state.refs.append((StorageWeakRef(buf.untyped_storage()), buf.untyped_storage().nbytes()))
    return default_hooks.allreduce_hook(None, bucket)


def probe_parks(job: Any, probe: BucketProbe) -> None:
    """As each `paused` report leaves this rank, note which of the last backward's bucket buffers
    are gone (test-only: wraps the job's control client)."""
    send = job._client.send

    def noting(msg: Any) -> bool:        # a record (gpuswap.protocol.records)
        if msg.op == "paused":
            probe.parked.append([ref.expired() for ref, _ in probe.refs])
        return send(msg)

    job._client.send = noting


def hang_in_park(job: Any) -> None:
    """Make this rank's park block forever once its groups are destroyed (test-only)."""
    teardown = job._regroup.teardown

    def hung() -> None:
        teardown()
        print(f"rank {dist.get_rank() if dist.is_initialized() else '?'}: hanging in the park (test hook)",
              file=sys.stderr, flush=True)
        threading.Event().wait()

    job._regroup.teardown = hung


def state_bytes(trained: dict[str, tuple[nn.Module, Any]]) -> int:
    """Bytes of this rank's training state, each storage once: parameters, gradients, optimizer
    state (a ZeroRedundancyOptimizer's in its local optimizer; DTensors by their local shard).
    What a RAM park must take off the device; the test compares it with what the daemon says."""
    tensors: list[torch.Tensor] = []
    for model, opt in trained.values():
        for p in model.parameters():
            tensors += [p] + ([p.grad] if p.grad is not None else [])
        for o in (opt, getattr(opt, "optim", None)):
            for st in (o.state.values() if o is not None else ()):
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def bound_group(mode: str, model: nn.Module, opt: Any) -> bool:
    """Whether what caches the default group holds the current one. On gloo a destroyed group
    that DDP still holds keeps working (docs/design/multi-rank.md section 3), so bitwise equality
    alone would not show a missing rebind; on NCCL it would be fatal."""
    world = dist.group.WORLD
    if mode == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        infos = [m._get_fsdp_state()._fsdp_param_group.mesh_info for m in model.modules()
                 if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None]
        return bool(infos) and all(i.shard_process_group is world for i in infos)
    return model.process_group is world and (mode != "zero" or opt.process_group is world)


def seen_group(groups: list[Any]) -> None:
    """Note the default group after a safepoint: a RAM park makes a new one."""
    if dist.group.WORLD is not groups[-1]:
        groups.append(dist.group.WORLD)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="ddp")
    ap.add_argument("--gate", default="")
    ap.add_argument("--hold-at", default="")
    ap.add_argument("--no-attach", type=int, default=-1)
    ap.add_argument("--hang-in-park", type=int, default=-1)
    ap.add_argument("--block-rank", type=int, default=-1)
    ap.add_argument("--block-file", default="")
    ap.add_argument("--fail-dir", default="")
    ap.add_argument("--probe-buckets", action="store_true")
    ap.add_argument("--wait-file", default="")
    ap.add_argument("--report-each-step", action="store_true")
    args = ap.parse_args()
    holds = {int(h) for h in args.hold_at.split(",") if h}
    faulthandler.dump_traceback_later(600, exit=True)   # a hang ends with its stacks
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    modes = args.modes.split(",")
    trained = {mode: build(mode) for mode in modes}
    probe = BucketProbe() if args.probe_buckets else None
    if probe is not None:
        trained["ddp"][0].register_comm_hook(probe, probe_hook)
    torch.manual_seed(100 + rank)                        # dropout differs per rank
    data = torch.Generator().manual_seed(7 + rank)
    attached: dict[str, Any] = {"data": data}
    for mode, (model, opt) in trained.items():
        attached[f"{mode}_model"], attached[f"{mode}_optimizer"] = model, opt
    if args.fail_dir:
        fail_hooks(Path(args.fail_dir), rank)
    job = NoJob() if rank == args.no_attach else gpuswap.attach(**attached)
    if rank == args.hang_in_park:
        hang_in_park(job)
    if probe is not None and getattr(job, "_client", None) is not None:
        probe_parks(job, probe)
    groups = [dist.group.WORLD]                          # every default group trained with (kept: ids unique)
    deadline = time.monotonic() + 600
    while args.wait_file and not os.path.exists(args.wait_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    for step in range(job.start_step, args.steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        if probe is not None:
            probe.refs = []
        for model, opt in trained.values():
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        job.safepoint(step)
        seen_group(groups)
        if args.report_each_step and not isinstance(job, NoJob):
            job.send(job._usage_msg())
        if args.gate and step in holds:
            deadline = time.monotonic() + 600
            while True:
                if rank == args.block_rank and os.path.exists(args.block_file):
                    Path(args.block_file + ".ack").touch()
                    while not os.path.exists(args.block_file + ".go") and time.monotonic() < deadline:
                        time.sleep(0.05)
                is_open = os.path.exists(args.gate) or os.path.exists(f"{args.gate}.{step}")
                seen = torch.tensor([int(is_open or time.monotonic() > deadline)])
                dist.all_reduce(seen, op=dist.ReduceOp.MAX)
                if seen.item():
                    break
                job.safepoint(step)
                seen_group(groups)
                time.sleep(0.02)
    job.close()
    nbytes = state_bytes(trained)
    bound = {mode: bound_group(mode, *mo) for mode, mo in trained.items()}
    for mode, (model, opt) in trained.items():
        if mode == "zero":
            opt.consolidate_state_dict(to=0)
        params = full_state(model)
        optim = opt.state_dict() if mode != "zero" or rank == 0 else None
        out = Path(args.out) / mode
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": params, "optimizer": local(optim), "rng": torch.get_rng_state(),
                    "data": data.get_state(), "groups": len(groups), "bound": bound[mode],
                    "state_bytes": nbytes, "buckets": probed(probe, model) if mode == "ddp" else None},
                   out / f"rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def probed(probe: BucketProbe | None, model: nn.Module) -> dict[str, Any] | None:
    """What the probe saw: per park, which buffers were freed; and the bytes of the last
    backward's buffers that exist now (after a resume: as many as the parameters')."""
    if probe is None:
        return None
    return {"parked": probe.parked, "live_bytes": sum(n for ref, n in probe.refs if not ref.expired()),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def fail_hooks(where: Path, rank: int) -> None:
    """The failures test_mr_disk.py asks for, through the files it creates (see the docstring)."""
    from gpuswap.runtime import ckparts

    write_part, write_manifest = ckparts.write_part, ckparts.write_manifest

    def part(directory, payload, seq=None):
        flag = where / f"part-r{rank}"
        if flag.exists():
            flag.unlink()
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        slow = where / f"slow-r{rank}"
        if slow.exists():
            return slowly(float(slow.read_text()), lambda: write_part(directory, payload, seq))
        return write_part(directory, payload, seq)

    def manifest(*a, **kw):
        if (where / "manifest").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return write_manifest(*a, **kw)

    ckparts.write_part, ckparts.write_manifest = part, manifest


def slowly(seconds: float, write: Any) -> Any:
    """Run `write` (a part's write) with every write to its file cut into 64-byte pieces spread
    evenly over at least `seconds`, as a slow disk would take them (test-only)."""
    from gpuswap.runtime import checkpoint

    original = checkpoint._HashingWriter.write
    pieces: list[int] = []

    def counting(self, data):                              # first pass: how many pieces in all
        pieces.append((memoryview(data).nbytes + 63) // 64)
        return memoryview(data).nbytes

    class Dry:
        def write(self, data):
            return counting(None, data)

        def flush(self):
            pass

    # The part's size is only known once written: take it from a dry run of the same save.
    dry = checkpoint._write_file_atomic
    checkpoint._write_file_atomic = lambda d, name, w: (w(Dry()), (0, "0" * 64))[1]
    try:
        write()
    finally:
        checkpoint._write_file_atomic = dry
    pause = seconds / max(1, sum(pieces))

    def slow(self, data):
        view = memoryview(data).cast("B")
        for i in range(0, view.nbytes, 64):
            time.sleep(pause)
            original(self, view[i:i + 64])
        return view.nbytes

    checkpoint._HashingWriter.write = slow
    try:
        return write()
    finally:
        checkpoint._HashingWriter.write = original


if __name__ == "__main__":
    main()
