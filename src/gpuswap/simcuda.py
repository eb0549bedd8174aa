"""A simulated CUDA device for machines without a GPU, as strict as the real driver observably is.

A process becomes a *simulated CUDA process* by calling `allocate(nbytes)` (a test job does, in
place of `torch.cuda`): it writes its own registration (pid, start time, and per GPU it touched
the bytes allocated there and those of the CUDA context its first call there created;
simrecords.py) into the directory named by
`GPUSWAP_SIM_CUDA_DIR`, which the daemon sets for every job on simulated GPUs.
Nobody tells the daemon which pid that is: it finds it as it would on a real node, in the
simulated NVML process list (`SimulatedGpus.list()`), which may name a child or grandchild of the
launched command. The daemon's simulated checkpoint driver (node/simdriver.py) records where the
driver has put each process in `driver/PID.json`; a process checkpointed there holds no device
memory and is absent from the process list, as on a real GPU (docs/transparent.md lists each
behaviour and its source).

The context is device memory too. NVML's nvmlDeviceGetComputeRunningProcesses lists "processes
with a compute context on a device", and its usedGpuMemory "is all of the memory used by the
application" (NVML API reference): a process that created a context and allocated nothing is
listed, holding its context (pytorch/pytorch#28113: 200-700 MB in nvidia-smi right after CUDA
init, "That is the size of the CUDA context"; #20532: 300-400 MB per process, released only by
quitting the process). A process has such a context on every GPU it touched, and NVML lists it
on each with what it holds there (a context alone where it only maps a peer's memory:
pytorch/pytorch#54564, tensorflow/tensorflow#52285, NVIDIA/DeepLearningExamples#776). So a
registration holds `context + nbytes` on each of its GPUs (`Held.used`), in that GPU's process
list and memory used, from its first `allocate` there (`allocate(0)` too) until the process exits. cuCheckpointProcessCheckpoint releases all of it: "the GPU memory contents
will be brought into host memory and all underlying references will be released" (CUDA driver API,
CUDA_CHECKPOINT), and nvidia-smi then shows the GPU at 1 MiB used with no process
(NVIDIA/cuda-checkpoint#31; #53: "the pid's device memory should drop to ~0"); a locked process
keeps it all; a restore brings it all back, on every GPU (it needs room on each).

A full GPU refuses memory, as a real one does. cudaMalloc "returns cudaErrorMemoryAllocation in
case of failure" (CUDA Runtime API, cudaMalloc), and PyTorch's caching allocator turns that into
torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class, a RuntimeError):
"CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a total capacity of 23.65 GiB of which
11.06 MiB is free. ..." (the message of torch >= 2.2, quoted in pytorch/pytorch#16417; older ones
"(GPU 0; 6.00 GiB total capacity; ...)", #59778). Creating the context needs device memory as
well: on a GPU other processes have filled, the first CUDA call fails with "CUDA error: out of
memory" (pytorch/pytorch#20532: every worker's context "cause[s] cuda OUT OF MEMORY ERROR";
#18766: "RuntimeError: CUDA error: out of memory" when several processes initialize CUDA at once;
TensorFlow's "failed call to cuDevicePrimaryCtxRetain: CUDA_ERROR_OUT_OF_MEMORY",
aws-deepracer-community/deepracer-for-cloud#13), which torch >= 2.8 raises as
torch.AcceleratorError, a RuntimeError too (None9527/None_Z-trainer#17). So `allocate` raises
`OutOfMemoryError` (below; `context_creation` tells the two apart) when the GPU's resident memory
(every resident registration's `used`, as the simulated NVML counts it: a checkpointed process
holds nothing) plus what the call adds exceeds the GPU's total; a call that adds nothing (a free,
`allocate` of fewer bytes) never fails, as cudaFree does not. The check and the write happen under
one lock (`SimDevice.exclusive`, an flock on `lock`), which the simulated driver's restore and
lock take too, so two processes racing for the last bytes cannot both get them, as the real
driver's allocator serialises them. The job learns each simulated GPU's size from `gpus.json`,
which the daemon writes when its simulated driver starts (read as untrusted input: a file the
daemon did not write, or one that cannot be read, makes `allocate` fail as CUDA does without a
device: "no CUDA-capable device is detected").

Layout of the state directory (the daemon's `simulated-driver/`):
  gpus.json        {"totals": [bytes of GPU 0, of GPU 1, ...]}: the simulated GPUs' sizes, written
                   by the daemon (atomically, at start), read by every simulated CUDA process
  lock             the device's lock (empty, the daemon's, readable by all: flock needs no write)
  procs/PID.json   a registration, written by the process itself (sticky, world-writable dir:
                   each user's processes register themselves; nobody can replace another's file)
  driver/PID.json  the driver's state for that process (simrecords.DriverRecord: state, stuck,
                   GPUs a restore's map moved), written by the daemon only (readable by
                   name, as any user can ask NVML and the driver about a pid; not listable)
A registration counts only while its process lives with the recorded start time and runs as the
file's owner: a reused pid or another user's forged file is ignored.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
import time
from pathlib import Path
from time import monotonic as _monotonic, sleep as _lock_sleep   # the lock's own wait, apart from `sync`'s
from typing import Iterator, Mapping, Optional

from gpuswap.fsutil import atomic_write_json
from gpuswap.protocol.env import SIM_CONTEXT_BYTES, SIM_CUDA_DIR
from gpuswap.simrecords import MAX_BYTES, MAX_GPUS, DriverRecord, Held, Registration   # noqa: F401 (re-exported)

RESIDENT = ("running", "locked")       # driver states in which a process holds device memory
GPUS_FILE, LOCK_FILE = "gpus.json", "lock"

# The device memory a process's CUDA context takes (module code, the driver's per-context buffers,
# and for a PyTorch process the cuBLAS/cuDNN handles it soon creates), which no free or empty_cache
# returns. Measured: PyTorch's own context at 287,047,680 bytes with lazy module loading and
# 666,632,192 without (pytorch/pytorch#86509, which made CUDA_MODULE_LOADING=LAZY torch's default;
# CUDA Programming Guide, "Lazy Loading"); "~300MB" with lazy loading, over 1000 MB before CUDA
# 11.7 (pytorch/pytorch#107667, ptrblck); 781 MB in nvidia-smi before any allocation
# (pytorch/pytorch#34323); 555 MiB for a bare primary context on a Blackwell RTX PRO 6000, growing
# with the SM count (ggml-org/llama.cpp#23604). 512 MiB is in that range for an H100 (132 SMs).
# GPUSWAP_SIM_CONTEXT_BYTES chooses another (read by the process when it creates its context).
DEFAULT_CONTEXT_BYTES = 512 * 2**20


def start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (immune to pid reuse), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def stopped(pid: int) -> bool:
    """True if the process is stopped by a signal (state T)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat[stat.rindex(")") + 2] in "Tt"
    except (OSError, ValueError, IndexError):
        return False


def context_bytes(env: Mapping[str, str] = os.environ) -> int:
    """The size of a simulated CUDA context: $GPUSWAP_SIM_CONTEXT_BYTES (bytes, or a size such as
    256MiB), else DEFAULT_CONTEXT_BYTES; a value that cannot be read is reported once and the
    default used."""
    text = env.get(SIM_CONTEXT_BYTES, "").strip()
    if not text:
        return DEFAULT_CONTEXT_BYTES
    from gpuswap.jobs import parse_size

    try:
        value = parse_size(text)
        if 0 <= value <= 2**50:
            return value
    except ValueError:
        pass
    print(f"gpuswap: ignoring {SIM_CONTEXT_BYTES}={text[:40]!r}: not a size; using {DEFAULT_CONTEXT_BYTES} bytes",
          file=sys.stderr, flush=True)
    return DEFAULT_CONTEXT_BYTES


def format_size(nbytes: int) -> str:
    """A size as PyTorch's allocator messages write it (c10/cuda/CUDACachingAllocator.cpp,
    format_size): up to 1 KiB in bytes, up to 1 MiB in KiB, up to 1 GiB in MiB, else GiB, two
    decimals (hence "Tried to allocate 1024.00 KiB", shllln/GenerativeGraph#5)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 2**20:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 2**30:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


class OutOfMemoryError(RuntimeError):
    """A simulated CUDA call found too little free memory on its GPU: cudaErrorMemoryAllocation.

    An allocation's message is the one torch.OutOfMemoryError carries ("CUDA out of memory. Tried
    to allocate ..."); a context creation's is the one the first CUDA call of a process fails with
    on a full GPU ("CUDA error: out of memory"): the module docstring gives the sources. A
    RuntimeError, as both of torch's are, so code that catches what torch raises catches it; the
    runtime's simulated device (runtime/simdevice.py) re-raises it as torch's own class.
    `gpu`: the node's GPU; `device`: the ordinal the process named (torch's "GPU N")."""

    def __init__(self, *, gpu: int, device: int, requested: int, free: int, total: int, held: int,
                 context_creation: bool) -> None:
        self.gpu, self.device, self.requested = gpu, device, requested
        self.free, self.total, self.held = free, total, held
        self.context_creation = context_creation
        where = f"(simulated GPU {gpu} of this node, gpuswap.simcuda)"
        if context_creation:
            text = (f"CUDA error: out of memory (creating the CUDA context, {format_size(requested)}, on GPU {device}: "
                    f"{format_size(free)} of its {format_size(total)} free) {where}")
        else:
            text = (f"CUDA out of memory. Tried to allocate {format_size(requested)}. GPU {device} has a total "
                    f"capacity of {format_size(total)} of which {format_size(free)} is free. Including non-PyTorch "
                    f"memory, this process has {format_size(held)} memory in use. {where}")
        super().__init__(text)


class SimDevice:
    """The registry both sides share: processes' registrations and the driver's record of them."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.procs, self.driver_dir = self.root / "procs", self.root / "driver"

    def prepare(self) -> None:
        """Make the directories (daemon side, at start)."""
        from gpuswap.fsutil import make_dir

        from gpuswap.fsutil import make_file

        make_dir(self.root, 0o711)
        make_dir(self.procs, 0o1733)       # like /tmp, but not listable by users
        make_dir(self.driver_dir, 0o711)   # a job reads its own state by name (its CUDA calls block on
                                           # it); nobody lists whose processes the driver holds
        make_file(self.root / LOCK_FILE, 0o644)

    def describe(self, totals: list[int]) -> None:
        """Say how big each simulated GPU is (daemon side, at start): `gpus.json`, atomically."""
        atomic_write_json(self.root / GPUS_FILE, {"totals": [int(t) for t in totals]}, 0o644)

    def totals(self) -> Optional[list[int]]:
        """Each simulated GPU's total bytes as the daemon described them, or None if there is no
        description this process can trust: absent, not a regular file, not written by the owner
        of the directory (the daemon), or not a list of 1 to MAX_GPUS sizes from 1 to MAX_BYTES."""
        from gpuswap.fsutil import read_small

        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            if os.stat(GPUS_FILE, dir_fd=fd, follow_symlinks=False).st_uid != os.fstat(fd).st_uid:
                return None
            raw = read_small(GPUS_FILE, 64 * 1024, dir_fd=fd)
            totals = json.loads(raw)["totals"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        finally:
            os.close(fd)
        if not isinstance(totals, list) or not 1 <= len(totals) <= MAX_GPUS:
            return None
        if not all(type(t) is int and 1 <= t <= MAX_BYTES for t in totals):
            return None
        return totals

    @contextlib.contextmanager
    def exclusive(self, timeout_s: Optional[float] = None) -> Iterator[None]:
        """The device's lock: whoever checks for room and then takes it holds this meanwhile (a
        process's `allocate`, the driver's restore and lock). An flock on `lock`, opened read-only
        (no write permission is needed to flock a file), released when the block ends or the
        process dies. `timeout_s`: give up with TimeoutError after that long (the daemon's side,
        which must not hang on a process that holds the lock and stops); None waits."""
        fd = os.open(self.root / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{self.root / LOCK_FILE} is not a regular file")
            if timeout_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                deadline = _monotonic() + timeout_s
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if _monotonic() >= deadline:
                            raise TimeoutError(f"the simulated device's lock was held for over {timeout_s:g} s") from None
                        _lock_sleep(0.005)
            yield
        finally:
            os.close(fd)      # releases the flock

    def used_on(self, gpu: int, but: Optional[int] = None) -> int:
        """Device memory resident on `gpu` now (as the simulated NVML counts it: every resident
        process's contexts and allocations there, reported or not), leaving out process `but`."""
        return sum(nbytes for pid, g, nbytes in self.resident() if g == gpu and pid != but)

    # -- registrations ----------------------------------------------------------------------
    def registration(self, pid: int) -> Optional[Registration]:
        """pid's registration if it is a living simulated CUDA process (whatever its driver state)."""
        path = self.procs / f"{int(pid)}.json"
        try:   # a user's entry: never follow a link or wait on a FIFO planted under that name
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            owner, raw = st.st_uid, os.read(fd, 256 * 1024)    # MAX_GPUS entries fit
        except OSError:
            return None
        finally:
            os.close(fd)
        reg = Registration.parse(raw)
        if reg is None or reg.pid != pid:
            return None
        if start_ticks(pid) != reg.start or _uid(pid) != owner:
            return None              # the process is gone (its pid maybe reused), or a forgery
        return reg

    def registrations(self) -> list[Registration]:
        """Every living simulated CUDA process; registrations of dead ones are removed."""
        out = []
        try:
            names = os.listdir(self.procs)
        except OSError:
            return []
        for name in names:
            if not name.endswith(".json") or not name[:-5].isdigit():
                continue
            reg = self.registration(int(name[:-5]))
            if reg is not None:
                out.append(reg)
            elif start_ticks(int(name[:-5])) is None:
                for stale in (self.procs / name, self.driver_dir / name):
                    try:
                        stale.unlink()
                    except OSError:
                        pass
        return sorted(out, key=lambda r: r.pid)

    # -- the driver's record ------------------------------------------------------------------
    def driver_record(self, reg: Registration) -> DriverRecord:
        """Where the simulated driver left this process: running where it allocated if the driver
        never touched it (or the record is of an earlier process with this pid, or unreadable)."""
        try:
            with open(self.driver_dir / f"{reg.pid}.json", "rb") as f:
                raw = f.read(256 * 1024)
        except OSError:
            return DriverRecord()
        return DriverRecord.parse(raw, reg.start) or DriverRecord()

    def set_driver_record(self, reg: Registration, rec: DriverRecord) -> None:
        atomic_write_json(self.driver_dir / f"{reg.pid}.json", rec.to_json(reg.start), 0o644)

    def placed(self, reg: Registration, rec: Optional[DriverRecord] = None) -> list[tuple[int, int]]:
        """(node GPU now, bytes it holds there while resident) for each GPU the process touched."""
        rec = self.driver_record(reg) if rec is None else rec
        return [(rec.where(h.gpu), h.used) for h in reg.held]

    def listed(self) -> list[tuple[int, int, int, bool]]:
        """(pid, gpu, bytes, whether NVML reports its bytes) for each GPU on which a process holds
        device memory now, its context there included: what NVML would list, a process once per GPU
        it touched. A checkpointed process holds nothing and is not listed."""
        out = []
        for reg in self.registrations():
            rec = self.driver_record(reg)
            if rec.state in RESIDENT:
                out.extend((reg.pid, gpu, used, reg.usage_reported) for gpu, used in self.placed(reg, rec))
        return out

    def resident(self) -> list[tuple[int, int, int]]:
        """(pid, gpu, bytes) of every process holding device memory now, per GPU, reported or not."""
        return [(pid, gpu, nbytes) for pid, gpu, nbytes, _ in self.listed()]

    def gpus_in_use(self) -> set[int]:
        """GPUs any living simulated CUDA process is on or was checkpointed from."""
        return {gpu for r in self.registrations() for gpu, _ in self.placed(r)}


def _uid(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


# -- the job's side: what a CUDA program does -------------------------------------------------
def allocate(nbytes: int, busy: bool = False, device: int = 0, usage_reported: bool = True) -> Registration:
    """Become a simulated CUDA process holding `nbytes` of allocations on CUDA device `device` (an
    ordinal within CUDA_VISIBLE_DEVICES, as with cudaSetDevice), plus a CUDA context there: created
    by the process's first call on that device (`context_bytes()`, read then) and kept, at that
    size, until the process exits, as a real context is. Per GPU, as a real process: a call on
    another device leaves what the process holds on the others as it was (their contexts stay),
    so a process that touched two GPUs is listed on both (simrecords.py gives the sources).
    `busy`: a kernel that does not finish until the process registers again without it, so a lock
    waits for it (and times out).

    Strict about room, as the real device (module docstring): with the GPU's resident memory
    (other processes') plus what this process would hold over its total, it raises
    `OutOfMemoryError` and its registration stays as it was. A first call on a GPU that finds no
    room for the context there registers nothing new (`context_creation`: "CUDA error: out of memory"); one that finds
    room for the context but not for `nbytes` keeps the context, registered with no allocations, as
    a real process does once its context exists (pytorch/pytorch#20532: freed only by quitting),
    and raises the allocation's error. A call that adds nothing never fails. No description of the
    GPUs (`gpus.json`) or a device ordinal past them: RuntimeError, as CUDA without that device.

    `usage_reported=False`: NVML lists the process but gives its usedGpuMemory as
    NVML_VALUE_NOT_AVAILABLE, which pynvml returns as None, as it may (NVML API reference,
    nvmlProcessInfo_t documents that value; "under WDDM ... always reported"); gpuswap's NVML reader
    takes it as unknown (node/gpus.py). The memory is still held: the GPU's memory used
    (nvmlDeviceGetMemoryInfo, device-wide, not per process) counts it, and so does the room check.

    A CUDA call like any other: while the driver holds this process (locked or checkpointed) it
    blocks before touching the registration, as `sync` does, so a frozen process registers nothing
    until it is thawed (CUDA docs, cuCheckpointProcessLock: "block further CUDA API calls")."""
    root = os.environ.get(SIM_CUDA_DIR)
    if not root:
        raise RuntimeError(f"{SIM_CUDA_DIR} is not set: not a job on simulated GPUs")
    nbytes = int(nbytes)
    if not 0 <= nbytes <= MAX_BYTES:
        raise ValueError(f"cannot allocate {nbytes} bytes")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")      # unset: every GPU, ordinal = GPU (CUDA's rule)
    gpu = int(visible.split(",")[device].strip()) if visible is not None else int(device)
    pid = os.getpid()
    dev = SimDevice(Path(root))
    while True:
        sync()
        with dev.exclusive():
            earlier = dev.registration(pid)
            if earlier is not None and dev.driver_record(earlier).state != "running":
                continue       # the driver locked it since `sync`: block again, as a CUDA call does
            return _allocate_locked(dev, earlier, gpu, device, nbytes, busy, usage_reported)


def _allocate_locked(dev: SimDevice, earlier: Optional[Registration], gpu: int, device: int, nbytes: int,
                     busy: bool, usage_reported: bool) -> Registration:
    totals = dev.totals()
    if totals is None:
        raise RuntimeError(f"CUDA error: no CUDA-capable device is detected (the simulated GPUs in "
                           f"{dev.root} are not described: {GPUS_FILE} is missing or unreadable)")
    if not 0 <= gpu < len(totals):
        raise RuntimeError(f"CUDA error: invalid device ordinal (simulated GPU {gpu}; this node has {len(totals)})")
    pid = os.getpid()
    where = dev.driver_record(earlier).where(gpu) if earlier is not None else gpu   # moved by a restore's GPU map
    if not 0 <= where < len(totals):
        raise RuntimeError(f"CUDA error: invalid device ordinal (simulated GPU {where}; this node has {len(totals)})")
    total, others = totals[where], dev.used_on(where, but=pid)
    mine = earlier.on(gpu) if earlier is not None else None      # what it holds on this GPU now
    held = mine.used if mine is not None else 0
    want = Held(gpu, mine.context if mine is not None else context_bytes(), nbytes)
    start = earlier.start if earlier is not None else start_ticks(pid) or 0
    base = earlier or Registration(pid, start, (want,), busy, usage_reported)
    path = dev.procs / f"{pid}.json"
    if want.used > held and others + want.used > total:
        if mine is None:
            if others + want.context > total:
                raise OutOfMemoryError(gpu=where, device=device, requested=want.context, free=max(0, total - others),
                                       total=total, held=0, context_creation=True)
            kept = base.with_held(Held(gpu, want.context, 0), busy=False, usage_reported=usage_reported)
            atomic_write_json(path, kept.to_json(), 0o644)     # the context exists now, and stays
            held = want.context
        raise OutOfMemoryError(gpu=where, device=device, requested=want.used - held,
                               free=max(0, total - others - held), total=total, held=held, context_creation=False)
    reg = base.with_held(want, busy=busy, usage_reported=usage_reported)
    atomic_write_json(path, reg.to_json(), 0o644)    # the daemon reads it (simulated NVML's process list)
    return reg


def sync(poll_s: float = 0.02) -> None:
    """A CUDA call: blocks while the driver holds this process locked or checkpointed (as real CUDA
    calls do: CUDA docs, cuCheckpointProcessLock, "block further CUDA API calls"; cuda-checkpoint
    README, CPU threads calling CUDA "may block until CUDA is resumed"), and for good once a failed
    restore left it stuck. A process that never registered is no CUDA process: nothing blocks it."""
    root = os.environ.get(SIM_CUDA_DIR)
    if not root:
        return
    dev = SimDevice(Path(root))
    me = dev.registration(os.getpid())
    if me is not None:
        wait_while_held(dev, me, poll_s)


def wait_while_held(dev: SimDevice, me: Registration, poll_s: float = 0.02) -> None:
    """`sync` for a process that knows its registration (`me`, this process's, as `allocate`
    returned it): one read of the driver's record (none if the driver never touched it), so a
    training loop can make it each step, as each real step's kernel launches are CUDA calls."""
    while dev.driver_record(me).state != "running":
        time.sleep(poll_s)
