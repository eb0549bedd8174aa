"""Helpers for tests that drive a real gpuswap daemon (imported by tests/conftest.py and tests)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from gpuswap.api.client import Client, ClientError

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
# The least time a test waits for a fact before calling it missing (a failure detector, not a window).
FACT_TIMEOUT_S = 180.0
# `Daemon.until` looks again after 0.05 s, then less and less often, down to every 0.25 s: a look
# costs ~2.5 ms of CPU (the request and the daemon's answer), and on a 2-core machine running the
# suite, four workers looking 10 times a second through long waits took about 5% of its CPU.
POLL_FIRST_S, POLL_MAX_S = 0.05, 0.25
USAGE_INTERVAL_S = "0.25"     # the tests' jobs' usage reports (GPUSWAP_USAGE_INTERVAL_S): see Daemon.env


def auto_workers(cores: int, load: float) -> int:
    """xdist workers for `cores` usable cores with `load` (1-minute load average) already on them.
    Tests wait on facts, never on a window of time, so the count changes only the speed. A test
    mostly waits on its daemon and jobs, so two workers per core keep the cores busy; each process
    already running elsewhere takes one worker's place. At least 2 (the slowest files run side by
    side), at most 8 (beyond that the daemons' start-up and the xdist overhead dominate)."""
    return max(2, min(8, round(2 * cores - load)))


def has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


class Daemon:
    """A real `gpuswap server` process and a client bound to its home."""

    def __init__(self, home: Path, args: list[str]):
        self.home, self.args = home, args
        self.proc: Optional[subprocess.Popen] = None
        self.client = Client(home, timeout=60)

    @property
    def env(self) -> dict[str, str]:
        # No GPUSWAP_CONFIG from the caller's shell: a test's daemon reads only what the test gives it.
        env = {k: v for k, v in os.environ.items() if k != "GPUSWAP_CONFIG"}
        # The jobs' runtimes report their step every USAGE_INTERVAL_S, not every 2 s (the default,
        # docs/runtime.md): a test waiting for a job to pass step N waited up to 2 s more for the
        # report after the fact, at each such wait. Only how soon the step is seen changes (nothing
        # judges a job by its reports' pace; status.json takes them at most every 0.5 s); a test
        # that sets its own interval keeps it (test_usage_heartbeat.py, test_mr_slow_disk.py).
        env.setdefault("GPUSWAP_USAGE_INTERVAL_S", USAGE_INTERVAL_S)
        return dict(env, GPUSWAP_HOME=str(self.home), PYTHONUNBUFFERED="1")

    def start(self) -> "Daemon":
        log = open(self.home / "daemon.out", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", *self.args],
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT)
        # A deadline that only catches a daemon that never answers (a daemon that dies fails at
        # once): at load 17 on 2 cores its start-up alone took over 30 s.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            # How it ended (an exit code, or -N for a signal) beside what it printed: a daemon that
            # dies before its first line (once in CI, not reproduced) says at least that much.
            assert self.proc.poll() is None, (f"daemon exited with {self.proc.returncode}: "
                                              + (self.home / "daemon.out").read_text())
            try:
                self.client.get("/v1/health")
                return self
            except ClientError:
                time.sleep(0.05)
        raise AssertionError("daemon did not come up")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cli(self, *args: str, user: Optional[int] = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """The real `gpuswap` CLI in a subprocess (optionally as another uid). GS_TEST_SLOW_CLI=S
        makes every call start S seconds late, as on a loaded machine: a test that depends on a
        window of seconds fails then (e.g. GS_TEST_SLOW_CLI=4 pytest tests/node)."""
        time.sleep(float(os.environ.get("GS_TEST_SLOW_CLI", "0")))
        kw: dict[str, Any] = {}
        if user is not None:
            kw.update(user=user, group=user, extra_groups=[], cwd="/tmp")
        return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, **kw)

    def submit(self, argv: list[str], **opts: Any) -> int:
        body = {"argv": argv, "cwd": str(self.home), "env": self.env, **opts}
        return int(self.client.post("/v1/jobs", body)["id"])

    def job(self, job_id: int) -> dict[str, Any]:
        return self.client.get(f"/v1/jobs/{job_id}")

    def until(self, job_id: int, pred: Callable[[dict[str, Any]], bool], timeout: float = 120,
              get: Optional[str] = None) -> dict[str, Any]:
        """Poll job `job_id` (or the record at path `get`) until `pred` holds. The deadline only
        catches a fact that never comes: it is never shorter than FACT_TIMEOUT_S, however short a
        test asks, since a loaded machine (load 20 on 2 cores) stretches every step of a job."""
        deadline = time.monotonic() + max(timeout, FACT_TIMEOUT_S)
        pause = POLL_FIRST_S
        while True:
            j = self.client.get(get) if get else self.job(job_id)
            if pred(j):
                return j
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} stuck: {json.dumps(j, indent=1)}")
            time.sleep(pause)
            pause = min(pause * 1.5, POLL_MAX_S)

    def state(self, job_id: int, *states: str, timeout: float = 120) -> dict[str, Any]:
        return self.until(job_id, lambda j: j["state"] in states, timeout)


HELD_TRAIN = Path(__file__).resolve().parent / "held_train.py"

_HOLD = """import os, sys, time
deadline = time.monotonic() + 600
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


class Gate:
    """A file the test creates to let its jobs go. A job made by `hold` or `train` cannot end before
    the test opens the gate, so the test's next call can never miss the state the job is in
    (an urgent job still RUNNING, its victim still PAUSED), however loaded the machine. Jobs give up
    waiting after 600 s, so a failed test leaves nothing behind that waits forever."""

    def __init__(self, path: Path):
        self.path = path

    def hold(self, then: str = "", before: str = "") -> list[str]:
        """A Python job that runs `before`, waits for the gate, then runs `then` (e.g. "print('eval ok')")."""
        return [sys.executable, "-c", before + "\n" + _HOLD + then, str(self.path)]

    def train(self, out: Path, steps: int = 200, step_time: float = 0.02, hidden: int = 64,
              hold_at: Optional[int] = None, keep_pace: bool = False) -> list[str]:
        """`train_cmd`, held at its safepoint from step `hold_at` (default steps - 2) until the gate
        opens: same final parameters, but it cannot complete before the test lets it. Once the gate
        is open its steps no longer sleep `step_time` (held_train.py), unless `keep_pace`."""
        held = steps - 2 if hold_at is None else hold_at
        return ([sys.executable, str(HELD_TRAIN), str(self.path), str(held)] + (["--keep-pace"] if keep_pace else [])
                + train_cmd(out, steps, step_time, hidden)[3:])

    def sh(self) -> list[str]:
        """The same wait in sh, for jobs of users who cannot run this interpreter (e.g. nobody)."""
        return ["sh", "-c", 'i=0; while [ ! -e "$1" ] && [ $i -lt 12000 ]; do sleep 0.05; i=$((i+1)); done',
                "gate", str(self.path)]

    def open(self) -> None:
        self.path.touch()


def forever(home: Path, first: str = "") -> list[str]:
    """A plain job (sh, no runtime) that runs shell command `first`, then until cancelled: for a
    test that needs a job to stay in its state while it looks (`sleep 30` could end first on a
    loaded machine). It gives up after 600 s like a Gate's jobs (its gate, `home`/never, is never
    opened)."""
    wait = Gate(home / "never").sh()
    return wait[:2] + [f"{first}\n{wait[2]}" if first else wait[2]] + wait[3:]


def reference_env(simulated: bool) -> dict[str, str]:
    """The environment of a reference run made outside gpuswap, on the device the job it is compared
    with runs on. A daemon on simulated GPUs gives its jobs GPUSWAP_SIMULATED_GPU=1, so they train on
    the CPU even where torch has CUDA (demo/train.py `pick_device`); CPU and CUDA results differ in
    their last bits, so the reference for such a job is made on the CPU the same way. A reference
    for a job on real GPUs (simulated=False) runs where torch puts it: CUDA on a GPU machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    if simulated:
        env["GPUSWAP_SIMULATED_GPU"] = "1"
    return env


def train_cmd(out: Path, steps: int = 200, step_time: float = 0.02, hidden: int = 64) -> list[str]:
    return [sys.executable, "-m", "gpuswap.demo.train", "--steps", str(steps), "--step-time", str(step_time),
            "--out", str(out), "--hidden", str(hidden)]


def ensure_user(name: str) -> tuple[int, int]:
    """(uid, gid) of an ordinary local user, created (no home, no login shell) if absent. Root only."""
    import pwd

    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                       check=False, capture_output=True)   # a parallel worker may have made it first
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


class AsUser:
    """Runs code as another uid in a forked child (the interpreter lives under /root, which an
    ordinary user cannot exec), so the kernel and the daemon see that user's real credentials."""

    def __init__(self, uid: int, gid: int):
        self.uid, self.gid = uid, gid

    def call(self, fn: Callable[[], Any], cwd: str = "/") -> Any:
        """fn() as the user, in `cwd` (entered as the user); its result must be JSON-able. An
        exception is returned as {"error": type name, "errno": ..., "message": ...}."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                os.chdir(cwd)
                out = json.dumps({"ok": fn()})
            except BaseException as e:   # report anything to the parent
                out = json.dumps({"error": type(e).__name__, "errno": getattr(e, "errno", None),
                                  "message": str(e)})
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
        res = json.loads(data)
        return res["ok"] if "ok" in res else res

    def api(self, home: Path, method: str, path: str, body: Optional[dict] = None) -> tuple[int, Any]:
        """One raw API request as the user: (status code, JSON body)."""
        import httpx

        # httpx imports httpcore, h11 and its backends only when it first connects, and the child
        # cannot read /root: connect once here, as root, on a client of its own that is closed
        # before the fork (the child's request goes on its own connection, with its own creds).
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "gpuswap.sock")),
                          base_url="http://x", timeout=60) as warm:
            warm.get("/v1/health")

        def run() -> list[Any]:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "gpuswap.sock")),
                              base_url="http://x", timeout=60) as c:
                r = c.request(method, path, json=body)
                return [r.status_code, r.json()]

        res = self.call(run)
        assert isinstance(res, list), res
        return res[0], res[1]

    def cli(self, home: Path, *args: str, cwd: str = "/tmp",
            env: Optional[dict[str, str]] = None) -> tuple[int, str, str]:
        """The real CLI (gpuswap.cli.main.main) as the user: (exit code, stdout, stderr)."""
        import io
        import contextlib

        from gpuswap.cli import main as cli_main, render, remote, slurm_wrap, top  # noqa: F401
        # Everything the CLI imports is loaded before the switch (the user cannot read /root),
        # rich's lazily imported parts too: a table rendered once, here.
        cli_main.build_parser()
        from rich.console import Console
        from rich.table import Table

        table = Table("warm :smiley:", title="[bold]x[/bold]")
        table.add_row("y")
        Console(file=io.StringIO(), width=80).print(table)

        def run() -> list[Any]:
            os.environ["GPUSWAP_HOME"] = str(home)
            os.environ.update(env or {})
            out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")   # `logs` writes to .buffer
            err = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main.main(list(args))
            out.flush()
            return [code, out.buffer.getvalue().decode(errors="replace"), err.getvalue()]

        res = self.call(run, cwd=cwd)
        assert isinstance(res, list), res
        return res[0], res[1], res[2]
