"""Fault-injection trial: `kill -9` the daemon at seeded points across every job state, feed it
hostile requests and a hostile job, and count what went wrong.

Each trial runs a real daemon (simulated GPU) with a low-priority training job whose final
parameters must equal an uninterrupted run's, and drives it through one scenario (preempted by
an urgent job and parked in RAM; paused to disk by its user; parked in RAM then spilled to disk).
The daemon is killed when the training job is first seen in a seeded target state (after a
seeded delay), restarted, and sometimes killed again. The urgent job is hostile: it connects to
its own control socket and sends malformed messages before it waits. Meanwhile a seeded sample
of malformed HTTP requests goes to the API. Then every job must end in its expected state with
its expected exit code, the training job's hash must be exact, no process of the trial may be
left, and no request may have been answered 5xx.

    python tests/fault_trial.py --trials 40 --seed 1     # prints the counts; exit 1 if any failed

tests/node/test_fault_injection.py runs a small seeded sample of the same trial in the suite.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpuswap_testing import TERMINAL, Daemon, Gate, reference_env, train_cmd  # noqa: E402

from gpuswap.api.client import ClientError  # noqa: E402

STEPS, HIDDEN, STEP_TIME = 150, 64, 0.02
ORDER = ["PENDING", "RUNNING", "PAUSING", "PAUSED", "RESUMING", "RUNNING again", "TERMINAL"]
URGENT_EXIT = 3
# Where the training job may be when the daemon is killed, per scenario ("submitted": the
# instant the submit was acknowledged).
TARGETS = {
    "preempt-ram": ["submitted", "RUNNING", "PAUSING", "PAUSED", "RESUMING"],
    "pause-disk": ["RUNNING", "PAUSING", "PAUSED", "RESUMING"],
    "spill": ["PAUSED", "PAUSING", "RESUMING"],
    "disk-full": ["PAUSED", "RESUMING"],      # its home fills up while the job runs, then frees
}
HOME_FS_BYTES = 256 << 20   # the disk-full scenario's home (tmpfs)
# A job that says hostile things on its own control socket, then waits for the test's word.
HOSTILE_JOB = r"""
import os, socket, sys, time
release = sys.argv[1]
payloads = [bytes.fromhex(h) for h in open(sys.argv[2]).read().split()]
ctl = os.environ.get("GPUSWAP_CONTROL")
held = []
if ctl:
    from gpuswap.protocol.channel import connect
    for p in payloads:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connect(s, ctl)
            s.sendall(p)
            held.append(s)
        except OSError as e:
            print("hostile send failed:", e, flush=True)
while not os.path.exists(release):
    time.sleep(0.05)
sys.exit(%d)
""" % URGENT_EXIT


def hostile_messages() -> list[bytes]:
    """Control-channel lines no runtime would send: overflowing, mistyped, oversized, not JSON."""
    big = 10 ** 30
    objs: list[Any] = [
        {"op": "usage", "device_bytes": big, "step": big},
        {"op": "usage", "device_bytes": -5, "step": "x"},
        {"op": "hello", "pid": "nope", "device_bytes": 1e308, "restored_step": -(2 ** 70), "parked": "yes"},
        {"op": "paused", "tier": "ram", "bytes": 10 ** 40, "seconds": "nan", "step": [1]},
        {"op": "resumed", "bytes": {"a": 1}, "seconds": 1e400 if False else 1e308},
        {"op": "error", "message": ["not", "a", "string"] * 1000},
        {"op": "checkpointed", "path": "x" * 100_000, "bytes": -1, "step": None},
        {"op": 5}, [1, 2, 3], None, "usage",
    ]
    lines = [json.dumps(o).encode() + b"\n" for o in objs]
    lines += [b"{\"op\": \"usage\", \"device_bytes\": 1" + b"0" * 5000 + b"}\n",   # a 5,000-digit int
              b"[" * 100_000 + b"\n",                                            # deep nesting
              b"\xff\xfe\x00garbage\n",                                          # not UTF-8
              b"x" * (2 << 20)]                                                  # over the line limit
    return lines


def hostile_requests() -> list[tuple[str, str, Optional[bytes]]]:
    """(method, path, raw body) the API must refuse with a 4xx (or answer), never a 5xx."""
    def j(obj: Any) -> bytes:
        return json.dumps(obj).encode()
    base = {"argv": ["true"], "cwd": "/"}
    return [
        ("POST", "/v1/jobs", j({**base, "mem": "9" * 400})),
        ("POST", "/v1/jobs", b'{"argv":["true"],"cwd":"/","mem":1' + b"0" * 400 + b"}"),
        ("POST", "/v1/jobs", j({**base, "mem": "9" * 308 + "GiB"})),
        ("POST", "/v1/jobs", b'{"argv":["\\ud800"],"cwd":"/"}'),
        ("POST", "/v1/jobs", b'{"argv":["true"],"cwd":"/","env":{"\\udc80":"x"}}'),
        ("POST", "/v1/jobs", b'{"argv":["true"],"cwd":"/","name":"\\ud800"}'),
        ("POST", "/v1/jobs", b'{"argv":["true"],"cwd":"\\ud800"}'),
        ("POST", "/v1/jobs", j({**base, "gpus": 10 ** 30})),
        ("POST", "/v1/jobs", j({**base, "argv": []})),
        ("POST", "/v1/jobs", j({**base, "argv": "true"})),
        ("POST", "/v1/jobs", j({**base, "priority": {"a": 1}})),
        ("POST", "/v1/jobs", j({**base, "argv": ["a\x00b"]})),
        ("POST", "/v1/jobs", j({**base, "cwd": "/\x00"})),
        ("POST", "/v1/jobs", b"not json"),
        ("POST", "/v1/jobs", b"[" * 100_000),
        ("POST", "/v1/jobs", b'{"argv":["true"],"cwd":"/","mem":1e999}'),
        ("GET", "/v1/jobs/99999999999999999999999", None),
        ("GET", "/v1/jobs/-1", None),
        ("GET", "/v1/jobs/1/log?offset=99999999999999999999", None),
        ("GET", "/v1/jobs/1/wait?timeout=nan", None),
        ("GET", "/v1/jobs?all=maybe", None),
        ("POST", "/v1/jobs/1/pause", b'{"to":"\\ud800"}'),
        ("POST", "/v1/jobs/1/pause", b"{"),
        ("POST", "/v1/jobs/1/cancel", b"\xff\xfe"),
        ("DELETE", "/v1/jobs", None),
        ("PUT", "/v1/gpus", b"{}"),
    ]


@dataclass
class Counts:
    trials: int = 0
    kills: int = 0
    kill_states: Counter = field(default_factory=Counter)
    jobs: int = 0
    lost: int = 0
    stuck: int = 0
    wrong_exit: int = 0
    wrong_hash: int = 0
    leftover_processes: int = 0
    requests: int = 0
    http_5xx: int = 0
    hostile_lines: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, other: "Counts") -> None:
        for name in ("trials", "kills", "jobs", "lost", "stuck", "wrong_exit", "wrong_hash",
                     "leftover_processes", "requests", "http_5xx", "hostile_lines"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.kill_states.update(other.kill_states)
        self.problems += other.problems

    @property
    def failures(self) -> int:
        return (self.lost + self.stuck + self.wrong_exit + self.wrong_hash + self.leftover_processes
                + self.http_5xx)

    def table(self) -> str:
        rows = [("trials", self.trials), ("daemon kill -9s", self.kills), ("jobs", self.jobs),
                ("lost", self.lost), ("stuck", self.stuck), ("wrong exit codes", self.wrong_exit),
                ("wrong final hashes", self.wrong_hash), ("processes left behind", self.leftover_processes),
                ("hostile requests", self.requests), ("5xx answers", self.http_5xx),
                ("hostile control lines", self.hostile_lines)]
        states = ", ".join(f"{k} {v}" for k, v in sorted(self.kill_states.items()))
        return "\n".join(f"{k:<24}{v}" for k, v in rows) + f"\n{'killed in state':<24}{states}"


def reference_hash(workdir: Path) -> str:
    out = workdir / "reference.json"
    # On the CPU, as the trial's job on simulated GPUs (GPUSWAP_SIMULATED_GPU=1), even where torch has CUDA.
    subprocess.run(train_cmd(out, STEPS, 0.0, HIDDEN), env=reference_env(simulated=True), check=True,
                   capture_output=True)
    return json.loads(out.read_text())["sha256"]


def _retry(fn: Callable[[], Any], timeout: float = 60) -> Any:
    """Call through a daemon restart: 'unavailable' (69) is retried, any other error is real."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except ClientError as e:
            if e.exit_code != 69 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Killer(threading.Thread):
    """Kills the daemon (-9) when the watched job is first seen in the target state, then restarts it."""

    def __init__(self, daemon: Daemon, job_id: int, target: str, delay: float, again: Optional[float],
                 counts: Counts):
        super().__init__(daemon=True)
        self.d, self.job_id, self.target, self.delay, self.again = daemon, job_id, target, delay, again
        self.counts, self.done, self.error = counts, threading.Event(), None

    def kill_and_restart(self, state: str) -> None:
        self.d.kill9()
        self.counts.kills += 1
        self.counts.kill_states[state] += 1
        self.d.start()

    def run(self) -> None:
        """Fire at the target state, or at the first later one if the target passed between polls."""
        try:
            want, seen_paused, deadline = ORDER.index(self.target), False, time.monotonic() + 180
            while time.monotonic() < deadline:
                try:
                    state = self.d.job(self.job_id)["state"]
                except ClientError:
                    state = None
                if state is not None:
                    seen_paused |= state == "PAUSED"
                    at = ORDER.index("TERMINAL" if state in TERMINAL else
                                     "RUNNING again" if state == "RUNNING" and seen_paused else state)
                    if at >= want:
                        time.sleep(self.delay)
                        self.kill_and_restart(ORDER[at] if at == want else f"{ORDER[at]} ({self.target} missed)")
                        if self.again is not None:
                            time.sleep(self.again)
                            self.kill_and_restart("second kill, at random")
                        return
                time.sleep(0.02)
        except BaseException as e:   # reported by the main flow
            self.error = e
        finally:
            self.done.set()


def run_trial(seed: int, reference: str, scenario: str, log: Callable[[str], None] = lambda _: None) -> Counts:
    rng = random.Random(seed)
    counts = Counts(trials=1)
    home = Path(tempfile.mkdtemp(prefix="gsf-", dir="/tmp"))
    mounted = scenario == "disk-full" and _mount_tmpfs(home)
    home.chmod(0o755)
    d = Daemon(home, ["--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--protect-multiple", "0",
                      "--max-switch-fraction", "1", "--no-calibrate"])
    target = rng.choice(TARGETS[scenario])
    delay = rng.uniform(0.0, 0.3)
    again = rng.uniform(0.0, 3.0) if rng.random() < 0.3 else None
    lines = rng.sample(hostile_messages(), k=rng.randint(3, 8))
    requests = rng.sample(hostile_requests(), k=rng.randint(6, 12))
    log(f"trial {seed}: {scenario}, kill at {target} +{delay:.2f}s"
        + (f", again {again:.1f}s later" if again is not None else "") + f", {len(lines)} hostile lines, "
        f"{len(requests)} hostile requests")
    expected: dict[int, tuple[str, int]] = {}
    release = home / "release"
    # The training job holds near its end until the scenario has been played out (a 3 s job on a
    # loaded machine could otherwise finish before it was ever preempted or paused).
    low_gate = Gate(home / "low-gate")
    try:
        d.start()
        _send_requests(home, requests, counts)
        # keep_pace: the killer may still strike while it runs after its gate opens (a random second kill)
        low = _retry(lambda: d.submit(low_gate.train(home / "low.json", STEPS, STEP_TIME, HIDDEN, keep_pace=True),
                                      name="low", priority="low"))
        expected[low] = ("COMPLETED", 0)
        if target == "submitted":   # acknowledged means durable: kill before anything else happens
            time.sleep(delay)
            killer = Killer(d, low, "PENDING", 0.0, again, counts)
        else:
            killer = Killer(d, low, target, delay, again, counts)
        killer.start()
        _retry(lambda: d.until(low, lambda j: j["state"] == "RUNNING" and j["runtime_attached"]
                               and (j["step"] or 0) >= 3, timeout=120))
        if scenario == "disk-full":
            if mounted:
                _fill_and_free(d, home, low, counts)
            _retry(lambda: d.client.post(f"/v1/jobs/{low}/pause", {"to": "ram"}))
            _retry(lambda: d.until(low, lambda j: j["state"] == "PAUSED", timeout=120))
            _retry(lambda: d.client.post(f"/v1/jobs/{low}/resume"))
        elif scenario == "preempt-ram":
            # A proper hello first, so the supervisor takes the job for an attached runtime and
            # folds what follows into the record the daemon reads.
            hello = json.dumps({"op": "hello", "pid": 1, "device_bytes": 1 << 20}).encode() + b"\n"
            (home / "hostile.hex").write_text("\n".join(ln.hex() for ln in [hello + lines[0], *lines[1:]]))
            urgent = _retry(lambda: d.submit([sys.executable, "-c", HOSTILE_JOB, str(release),
                                              str(home / "hostile.hex")], name="urgent", priority="urgent"))
            counts.hostile_lines += len(lines)
            expected[urgent] = ("FAILED", URGENT_EXIT)
            _retry(lambda: d.until(low, lambda j: j["state"] == "PAUSED", timeout=120))
            release.touch()
        else:
            _retry(lambda: d.client.post(f"/v1/jobs/{low}/pause", {"to": "ram" if scenario == "spill" else "disk"}))
            _retry(lambda: d.until(low, lambda j: j["state"] == "PAUSED", timeout=120))
            if scenario == "spill":
                _retry(lambda: d.client.post(f"/v1/jobs/{low}/pause", {"to": "disk"}))
                _retry(lambda: d.until(low, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk",
                                       timeout=120))
            _retry(lambda: d.client.post(f"/v1/jobs/{low}/resume"))
        low_gate.open()
        killer.done.wait(180)
        if killer.error is not None:
            counts.problems.append(f"trial {seed}: killer: {killer.error!r}")
        _check(d, home, expected, reference, counts, seed)
    except Exception as e:   # a wait that never came true is a stuck job; record and go on
        counts.stuck += 1
        counts.problems.append(f"trial {seed} ({scenario}, kill at {target}): {type(e).__name__}: {e}"[:2000])
    finally:
        release.touch()
        low_gate.open()
        d.stop()
        counts.leftover_processes += _leftovers(home, counts.problems, seed)
        if mounted:
            subprocess.run(["umount", "-l", str(home)], check=False)
        shutil.rmtree(home, ignore_errors=True)
    counts.jobs += len(expected)
    return counts


def _mount_tmpfs(path: Path) -> bool:
    """A small filesystem of the trial's own for the daemon's home, so it can really fill up."""
    if os.geteuid() != 0:
        return False
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={HOME_FS_BYTES},mode=0755", "tmpfs", str(path)],
                         capture_output=True)
    return res.returncode == 0


def _fill_and_free(d: Daemon, home: Path, low: int, counts: Counts) -> None:
    """Fill the home's filesystem to the last byte while the job runs; the API must refuse what it
    cannot record (4xx or 507 Insufficient Storage, never another 5xx); then free it again."""
    filler = home / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * (1 << 20)
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:                      # the last partial megabyte, byte-exact
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    body = json.dumps({"argv": ["true"], "cwd": "/"}).encode()
    full_requests = [("POST", "/v1/jobs", body), ("POST", f"/v1/jobs/{low}/pause", b'{"to":"disk"}'),
                     ("POST", f"/v1/jobs/{low}/resume", b"{}"), ("GET", f"/v1/jobs/{low}", None)]
    _send_requests(home, full_requests, counts, allowed={507})
    filler.unlink()


def _send_requests(home: Path, requests: list[tuple[str, str, Optional[bytes]]], counts: Counts,
                   allowed: frozenset[int] | set[int] = frozenset()) -> None:
    """Each request must get an answer below 500 (or in `allowed`); a dropped connection counts as a 5xx."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "gpuswap.sock")),
                      base_url="http://gpuswap", timeout=60) as http:
        for method, path, body in requests:
            counts.requests += 1
            shown = f"{method} {path} {body[:80] if body else b''!r}"
            headers = {"Content-Type": "application/json"} if body is not None else {}
            try:
                try:
                    r = http.request(method, path, content=body, headers=headers)
                except httpx.TransportError:   # once more on a new connection: a kept-alive one may have closed
                    with httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "gpuswap.sock")),
                                      base_url="http://gpuswap", timeout=60) as fresh:
                        r = fresh.request(method, path, content=body, headers=headers)
            except httpx.TransportError as e:
                counts.http_5xx += 1
                counts.problems.append(f"{shown}: no answer ({e!r})")
                continue
            if r.status_code >= 500 and r.status_code not in allowed:
                counts.http_5xx += 1
                counts.problems.append(f"{shown}: {r.status_code} {r.text[:200]}")


def _check(d: Daemon, home: Path, expected: dict[int, tuple[str, int]], reference: str, counts: Counts,
           seed: int) -> None:
    listed = {j["id"] for j in _retry(lambda: d.client.get("/v1/jobs"))}
    for job_id, (state, code) in expected.items():
        if job_id not in listed:
            counts.lost += 1
            counts.problems.append(f"trial {seed}: job {job_id} lost")
            continue
        try:
            j = _retry(lambda: d.state(job_id, *TERMINAL, timeout=180))
        except AssertionError as e:
            counts.stuck += 1
            counts.problems.append(f"trial {seed}: job {job_id} stuck: {str(e)[:1500]}")
            continue
        if (j["state"], j["exit_code"]) != (state, code):
            counts.wrong_exit += 1
            counts.problems.append(f"trial {seed}: job {job_id} ended {j['state']} ({j['exit_code']}), "
                                   f"expected {state} ({code}): {[e['reason'] for e in j['events']]}")
    result = home / "low.json"
    if not result.exists() or json.loads(result.read_text())["sha256"] != reference:
        counts.wrong_hash += 1
        counts.problems.append(f"trial {seed}: the training job's final parameters differ from an "
                               f"uninterrupted run's")


def _leftovers(home: Path, problems: list[str], seed: int) -> int:
    """Processes of this trial still alive once every job ended and the daemon stopped."""
    deadline = time.monotonic() + 120    # supervisors write the exit status, then exit
    while True:
        left = [p for p in psutil.process_iter(["pid", "cmdline"])
                if str(home) in " ".join(p.info["cmdline"] or [])]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in left:
        problems.append(f"trial {seed}: left behind: pid {p.pid} {' '.join(p.info['cmdline'] or [])[:200]}")
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(left)


def run(trials: int, seed: int, log: Callable[[str], None] = print, reference: Optional[str] = None) -> Counts:
    """`reference`: the hash of STEPS uninterrupted steps of width HIDDEN on the CPU, where the
    caller has it (the suite's reference_hashes fixture); run here otherwise."""
    if reference is None:
        workdir = Path(tempfile.mkdtemp(prefix="gsf-ref-"))
        try:
            reference = reference_hash(workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    total = Counts()
    for i in range(trials):
        scenarios = sorted(TARGETS)     # each in turn, so even a short run covers every one
        total.add(run_trial(seed * 100_003 + i, reference, scenarios[(seed + i) % len(scenarios)], log))
    return total


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    started = time.monotonic()
    total = run(args.trials, args.seed)
    print(f"\nfault-injection trial: seed {args.seed}, {time.monotonic() - started:.0f} s, "
          f"{os.cpu_count()} CPUs, simulated GPU")
    print(total.table())
    for p in total.problems:
        print("  -", p)
    return 1 if total.failures else 0


if __name__ == "__main__":
    sys.exit(main())
