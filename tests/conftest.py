"""Fixtures that start a real gpuswap daemon process on a private GPUSWAP_HOME with simulated GPUs."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest

import gpuswap
from gpuswap_testing import Daemon, auto_workers, has_gpu, reference_env, train_cmd


def _bytecode_once() -> None:
    """Under PYTHONDONTWRITEBYTECODE=1 (set in the sandboxes the suite runs in) no process wrote
    gpuswap's bytecode, so each of the suite's ~1,500 Python processes (daemons, supervisors, CLI
    calls, jobs) compiled every gpuswap module it imported again, ~0.07 CPU-s a daemon or
    supervisor, and each xdist worker rewrote every test module's asserts (~4 CPU-s of its ~9 s
    collection). gpuswap's bytecode is compiled once here, before any worker or daemon starts (the
    xdist controller, or the only pytest process), into the usual __pycache__ (git-ignored), which
    the children read though they write none; and pytest's processes cache their rewritten test
    modules as they would without the variable. Only how fast modules load changes: a changed
    source is compiled again (its mtime is in the cache), the code run is the same."""
    if not sys.dont_write_bytecode:
        return
    sys.dont_write_bytecode = False
    if "PYTEST_XDIST_WORKER" not in os.environ:
        import compileall

        compileall.compile_dir(Path(gpuswap.__file__).parent, quiet=1)


_bytecode_once()

DURATIONS = Path(__file__).with_name("durations.json")
SLOW_UNRECORDED_S = 60


def pytest_xdist_auto_num_workers(config: Any) -> int:
    """`-n auto` (pyproject's addopts): the worker count fits this machine as it is now."""
    return auto_workers(len(os.sched_getaffinity(0)), os.getloadavg()[0])


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    # Longest files first: `--dist loadfile` hands whole files to the workers in this order (with
    # `--no-loadscope-reorder`; xdist's own order is by test count, which put the slowest files,
    # of one to three tests, last), so the longest start at once instead of ending the run alone
    # on one worker. Seconds from tests/durations.json (tests/record_durations.py); a file it
    # does not name counts as long if it has `slow` tests.
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    slow = {item.path for item in items if "slow" in item.keywords}
    root = Path(str(config.rootpath))

    def longest_first(item: Any) -> int:
        recorded = seconds.get(Path(str(item.path)).relative_to(root).as_posix())
        return -(recorded if recorded is not None else SLOW_UNRECORDED_S if item.path in slow else 0)

    items.sort(key=longest_first)       # stable: a file's tests stay together, in their order
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a real NVIDIA GPU (none found through NVML)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def home() -> Any:
    # Short path: Unix socket paths are limited to 108 bytes. World-traversable for other-user tests.
    d = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_daemon(home: Path) -> Any:
    daemons: list[Daemon] = []

    def make(*args: str, calibrate: bool = False) -> Daemon:
        # Tests' jobs live seconds, not hours: the default switch-time cap would protect them all.
        args = list(args) or ["--simulate-gpus", "1x80GiB", "--min-runtime", "1"]
        args = args if "--max-switch-fraction" in args else args + ["--max-switch-fraction", "1"]
        # A test that sets --min-runtime gets that protection after a start or resume, not 4 x the
        # estimated park + resume (the --protect-multiple default, ~4 s for a test's job): each
        # preemption waited it out, ~3 s more than the floor the test asked for. A test about
        # cost-aware protection names --protect-multiple itself or keeps the defaults (no
        # --min-runtime: test_protection_live.py).
        if "--min-runtime" in args and "--protect-multiple" not in args:
            args = args + ["--protect-multiple", "0"]
        # Calibration (a 128 MiB write+fsync and RAM copies, ~1 s of CPU) at each of the suite's
        # ~160 daemon starts was a fifth of its CPU, and its figures vary with the machine's load.
        # Tests about the figures ask for it; the others start from the documented defaults.
        d = Daemon(home, args if calibrate else args + ["--no-calibrate"])
        daemons.append(d)
        return d.start()

    yield make
    # kill -9, not SIGTERM: the test is over and its home is deleted next, so how the daemon would
    # stop matters to nobody here (a clean stop took ~0.3 s of each test's teardown: uvicorn's exit
    # tick and the interpreter's finalization). Tests about stopping stop it themselves
    # (test_as_a_service.py, the restart tests), and a daemon killed is as crash-safe as it is
    # anywhere else (test_crash_safety.py).
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.kill9()
    # Leave no job processes behind: supervisors and jobs run in their own sessions.
    subprocess.run(["pkill", "-9", "-f", str(home)], check=False)


@pytest.fixture
def daemon(make_daemon: Any) -> Daemon:
    return make_daemon()


@pytest.fixture(scope="session")
def reference_hashes(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """sha256 of the demo model's parameters after N uninterrupted steps, outside gpuswap, on the
    device of the job it is compared with: the CPU for a daemon on simulated GPUs (the default;
    its jobs run with GPUSWAP_SIMULATED_GPU=1), CUDA for a daemon on real GPUs (simulated=False).
    Each is run once per pytest run, not once per xdist worker (a PyTorch process, ~2 CPU-s): the
    first worker to need it runs it under a lock in the run's base temporary directory, which the
    workers share (each worker's own is inside it), and the others read its result."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reference-hashes"
    shared.mkdir(exist_ok=True)
    cache: dict[tuple[int, int, bool], str] = {}

    def get(steps: int, hidden: int = 64, simulated: bool = True) -> str:
        if (steps, hidden, simulated) not in cache:
            want = "cpu" if simulated else "cuda"
            name = f"{steps}-{hidden}-{want}"
            done = shared / f"{name}.json"
            with open(shared / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)     # another worker running it: wait for its result
                if not done.exists():
                    out = Path(tempfile.mkdtemp(dir=shared)) / "ref.json"
                    subprocess.run(train_cmd(out, steps, 0.0, hidden), env=reference_env(simulated), check=True,
                                   capture_output=True)
                    os.replace(out, done)
            result = json.loads(done.read_text())
            assert result["device"] == want, f"the reference ran on {result['device']}, its job on {want}"
            cache[steps, hidden, simulated] = result["sha256"]
        return cache[steps, hidden, simulated]

    return get
