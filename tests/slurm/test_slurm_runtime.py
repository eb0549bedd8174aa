"""The Slurm side of the runtime and `gpuswap slurm-wrap`, without Slurm daemons: a fake Slurm
environment, real processes, real signals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.runtime import slurm

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_detection_and_default_checkpoint_dir(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "2"}
    cfg = slurm.config_from_env(env)
    assert cfg is not None and cfg.slurm and cfg.job_id == "42" and cfg.control is None
    assert cfg.ckpt_dir == str(tmp_path / ".gpuswap" / "ckpt" / "42")
    assert slurm.restart_count(env) == 2
    assert slurm.config_from_env({**env, "GPUSWAP_CKPT_DIR": "/x"}).ckpt_dir == "/x"
    assert slurm.config_from_env({**env, "GPUSWAP_SLURM": "0"}) is None
    assert slurm.config_from_env({}) is None


def test_signal_spec_parsing() -> None:
    assert slurm.parse_signals(slurm.DEFAULT_SIGNALS) == [signal.SIGUSR2, signal.SIGTERM]
    assert signal.SIGUSR1 not in slurm.parse_signals(slurm.DEFAULT_SIGNALS)  # NCCL's
    assert slurm.parse_signals("SIGUSR1 15") == [signal.SIGUSR1, signal.SIGTERM]
    assert slurm.parse_signals("none") == []
    for bad in ("FOO", "KILL"):
        with pytest.raises(ValueError):
            slurm.parse_signals(bad)


def _demo(tmp: Path, *, wrap: bool, steps: int = 400) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "gpuswap.demo.train", "--steps", str(steps), "--step-time", "0.01",
           "--log-every", "1", "--out", str(tmp / "result.json")]
    if wrap:
        cmd = [sys.executable, "-m", "gpuswap.cli.main", "slurm-wrap", "--", *cmd]
    return subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_training(p: subprocess.Popen) -> None:
    assert p.stdout is not None
    for line in p.stdout:  # attach() has installed the handlers once training prints
        if line.startswith("train: step 5/"):
            return
    raise AssertionError(p.stderr.read() if p.stderr else "no output")


@pytest.mark.parametrize("wrap", [False, True], ids=["direct", "slurm-wrap"])
def test_signal_checkpoints_at_safepoint_and_exits_75(tmp_path: Path, wrap: bool) -> None:
    p = _demo(tmp_path, wrap=wrap)
    _wait_training(p)
    p.send_signal(signal.SIGUSR2)
    _, err = p.communicate(timeout=180)
    assert p.returncode == REQUEUE_EXIT_CODE, err
    assert "got SIGUSR2 from Slurm" in err
    if wrap:
        assert "slurm-wrap: forwarding SIGUSR2" in err
    manifests = sorted((tmp_path / ".gpuswap" / "ckpt" / "7").glob("ckpt-*.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["job_id"] == "7"


def test_slurm_wrap_exit_codes(tmp_path: Path) -> None:
    def wrap(*args: str) -> int:
        return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "slurm-wrap", *args],
                              capture_output=True, timeout=180).returncode

    assert wrap("--", "sh", "-c", "exit 3") == 3
    assert wrap("--", "sh", "-c", "kill -KILL $$") == 128 + signal.SIGKILL  # like bash: 137
    assert wrap() == 64 and wrap("--signals", "BOGUS", "--", "true") == 64
    assert wrap("--", str(tmp_path / "missing")) == 127


def test_slurm_wrap_forwards_to_a_child_without_gpuswap(tmp_path: Path) -> None:
    """A child that never imports gpuswap simply gets the signal: SIGTERM kills it, the
    wrapper reports 143 as a shell would."""
    p = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "slurm-wrap", "--",
                          "sh", "-c", "echo ready; exec sleep 600"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"  # handlers are in place
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 128 + signal.SIGTERM, err     # killed by the signal (a finished sleep exits 0)


REATTACH = """
import os, signal, sys, time
import torch
import gpuswap

model = torch.nn.Linear(2, 2)
job = gpuswap.attach(model=model)
for step in range(3):
    job.safepoint(step)
for sig in (signal.SIGUSR2, signal.SIGTERM):   # what a framework's signal teardown does
    signal.signal(sig, signal.SIG_DFL)
job = gpuswap.attach(model=model)              # e.g. a second Lightning fit
for step in range(500):
    if step == 5:
        os.kill(os.getpid(), signal.SIGUSR2)
    job.safepoint(step)
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_second_attach_takes_back_replaced_signal_handlers(tmp_path: Path) -> None:
    """Handlers put back by someone else after the first attach are ours again after the next
    one: the signal becomes a checkpoint and exit 75, not death by SIGUSR2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="8", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", REATTACH], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == REQUEUE_EXIT_CODE, (p.returncode, p.stderr)
    assert p.stderr.count("got SIGUSR2 from Slurm") == 1
    manifests = sorted((tmp_path / ".gpuswap" / "ckpt" / "8").glob("ckpt-*.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["step"] >= 5


SELF_SIGNAL = """
import os, signal, sys, time
import torch
import gpuswap

job = gpuswap.attach(model=torch.nn.Linear(2, 2))
for step in range(500):
    if step == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    job.safepoint(step)
    time.sleep(0.01)
sys.exit(3)
"""


@pytest.mark.parametrize("value", ["TERMM", "KILL", "99", "SEGV"])
def test_a_bad_signal_list_is_ignored_with_one_line_not_a_traceback(tmp_path: Path, value: str) -> None:
    """`$GPUSWAP_SLURM_SIGNALS` is the job owner's text, read at attach while the job trains: a value
    that is no signal list (or a fault signal, whose handler would spin forever) gets one line and
    the default signals, and SIGTERM still checkpoints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="12", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit",
               GPUSWAP_SLURM_SIGNALS=value,
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", SELF_SIGNAL], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=180)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == REQUEUE_EXIT_CODE, (p.returncode, p.stderr)
    assert "gpuswap: ignoring GPUSWAP_SLURM_SIGNALS: " in p.stderr and "using USR2,TERM" in p.stderr
    assert len(list((tmp_path / ".gpuswap" / "ckpt" / "12").glob("ckpt-*.json"))) == 1
    assert subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "slurm-wrap", "--signals", value, "--",
                           "true"], env=env, capture_output=True, timeout=180).returncode == 64


SHAPED = """
import os, signal, sys, time
import torch
import gpuswap


class Signals:
    # State whose restore gets Slurm's signal (third argument "signal"): the moment a checkpoint loads.

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        if sys.argv[3:] == ["signal"]:
            os.kill(os.getpid(), signal.SIGUSR2)


shape, out = tuple(int(n) for n in sys.argv[1].split("x")), int(sys.argv[2])
t = torch.zeros(shape)
job = gpuswap.attach(t=t, model=torch.nn.Linear(2, out), signals=Signals())
print(f"start {job.start_step}", flush=True)
for step in range(job.start_step, 500):
    if step == 5:
        os.kill(os.getpid(), signal.SIGUSR2)
    t += 1
    job.safepoint(step)
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_checkpoint_that_does_not_fit_the_objects_ends_the_job_with_one_line(tmp_path: Path) -> None:
    """A restart whose script attaches other shapes than the checkpoint holds (the script was edited
    between requeues) must not resume: a tensor was broadcast into the new shape and training went on
    from that wrong state; a module's size mismatch ended the job with a traceback. Now: one line,
    exit 1, and the checkpoint is kept for the script that fits it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="13", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))

    def run(shape: str, out: int, restarts: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SHAPED, shape, str(out)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=180, env=dict(env, SLURM_RESTART_COUNT=str(restarts)))

    first = run("4", 2, 0)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr
    [manifest] = (tmp_path / ".gpuswap" / "ckpt" / "13").glob("ckpt-*.json")
    saved_step = json.loads(manifest.read_text())["step"]
    for shape, out in (("3x4", 2), ("4", 3)):    # a broadcastable tensor; a module of another size
        p = run(shape, out, 1)
        assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
        assert "start" not in p.stdout and "Traceback" not in p.stderr, p.stderr
        lines = [line for line in p.stderr.splitlines() if "cannot resume" in line]
        assert len(lines) == 1 and "does not fit the attached objects" in lines[0], p.stderr
    p = run("4", 2, 1)             # the script that fits it resumes after the saved step, runs to its end
    assert p.returncode == 3 and p.stdout.startswith(f"start {saved_step + 1}\n"), (p.stdout, p.stderr)


def test_a_job_given_another_jobs_checkpoint_directory_does_not_resume_its_state(tmp_path: Path) -> None:
    """Two Slurm jobs given one GPUSWAP_CKPT_DIR (a job array with a fixed directory): the second
    restored the first one's weights silently and trained on from its step. Now it ends at attach
    with one line naming the other job, writes nothing there, and the first job's checkpoint still
    resumes the first job; GPUSWAP_ADOPT_CHECKPOINTS=<that job> continues its training on purpose."""
    shared = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit", GPUSWAP_CKPT_DIR=str(shared),
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))

    def run(job: str, restarts: int, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SHAPED, "4", "2"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=180, env=dict(env, SLURM_JOB_ID=job, SLURM_RESTART_COUNT=str(restarts), **extra))

    first = run("101", 0)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr
    [manifest] = shared.glob("ckpt-*.json")
    saved_step = json.loads(manifest.read_text())["step"]
    other = run("102", 0)
    assert other.returncode == 1 and "start" not in other.stdout, (other.stdout, other.stderr)
    assert "Traceback" not in other.stderr, other.stderr
    [line] = [x for x in other.stderr.splitlines() if "cannot resume" in x]
    assert "written by job 101, not by this job (102)" in line and "GPUSWAP_ADOPT_CHECKPOINTS=101" in line
    assert list(shared.glob("ckpt-*.json")) == [manifest]            # nothing of job 102's written there
    adopted = run("103", 0, GPUSWAP_ADOPT_CHECKPOINTS="101")          # on purpose: resumes it, to its end
    assert adopted.returncode == 3 and adopted.stdout.startswith(f"start {saved_step + 1}\n"), adopted.stderr
    assert f"resuming from checkpoint seq 1 (step {saved_step}) of job 101" in adopted.stderr
    again = run("101", 1)                                              # the owner's restart resumes it
    assert again.returncode == 3 and again.stdout.startswith(f"start {saved_step + 1}\n"), again.stderr


def test_a_signal_while_the_checkpoint_is_restored_checkpoints_at_the_first_safepoint(tmp_path: Path) -> None:
    """Slurm's signal during `attach`'s restore (a time limit's warning, or a second preemption,
    while a large checkpoint loads) met the default action: the job died by SIGUSR2, unrequeued,
    with nothing saved. Now it is caught from the start of attach and acted on at the first safepoint."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="14", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))

    def run(mode: str, restarts: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SHAPED, "4", "2", mode], cwd=tmp_path, capture_output=True,
                              text=True, timeout=180, env=dict(env, SLURM_RESTART_COUNT=str(restarts)))

    first = run("", 0)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr
    ckpt = tmp_path / ".gpuswap" / "ckpt" / "14"
    saved_step = max(json.loads(m.read_text())["step"] for m in ckpt.glob("ckpt-*.json"))
    second = run("signal", 1)
    assert second.returncode == REQUEUE_EXIT_CODE, (second.returncode, second.stderr)
    assert second.stdout.startswith(f"start {saved_step + 1}\n") and "got SIGUSR2 from Slurm" in second.stderr
    steps = sorted(json.loads(m.read_text())["step"] for m in ckpt.glob("ckpt-*.json"))
    assert steps == [saved_step, saved_step + 1], steps     # saved again at its first safepoint
    third = run("", 2)
    assert third.returncode == 3 and third.stdout.startswith(f"start {saved_step + 2}\n"), third.stderr


BETWEEN_PHASES = """
import os, signal, sys, time
import torch
import gpuswap
from gpuswap.runtime import slurm

job = gpuswap.attach(model=torch.nn.Linear(2, 2))
for step in range(3):
    job.safepoint(step)
os.kill(os.getpid(), signal.SIGUSR2)       # after phase 1's last safepoint: an eval, a save between phases
deadline = time.monotonic() + 60
while not slurm._bridge.received and time.monotonic() < deadline:     # the fact: the signal was acted on
    time.sleep(0.001)
job = gpuswap.attach(model=torch.nn.Linear(2, 2))      # phase 2, e.g. a second fit()
for step in range(job.start_step, 50):
    job.safepoint(step)
sys.exit(3)
"""


def test_a_signal_between_two_attaches_checkpoints_at_the_next_ones_first_safepoint(tmp_path: Path) -> None:
    """A signal after the first attach's last safepoint was asked of that job, whose loop had
    ended: the second phase trained to its end with nothing saved (Slurm kills it at the time
    limit, unrequeued). Now the checkpoint is taken at the second attach's first safepoint."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="15", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", BETWEEN_PHASES], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == REQUEUE_EXIT_CODE, (p.returncode, p.stderr)
    manifests = [json.loads(m.read_text()) for m in (tmp_path / ".gpuswap" / "ckpt" / "15").glob("ckpt-*.json")]
    assert [(m["attach"], m["step"]) for m in manifests] == [(2, 0)]


class _FakeJob:
    world_size = 1

    def __init__(self) -> None:
        self.asked: list[str] = []

    def request_pause(self, tier: str) -> None:
        self.asked.append(tier)

    def pause_asked(self) -> str | None:
        return self.asked[-1] if self.asked else None


def test_the_bridge_hands_a_signal_to_the_next_attach_whichever_way_it_arrives() -> None:
    """No thread, no timing: the pump's `_act` called directly as it would run."""
    bridge = slurm.SignalBridge(None, [])
    first, second, third = _FakeJob(), _FakeJob(), _FakeJob()
    bridge.deliver_to(first)
    bridge._act(signal.SIGUSR2)                 # during phase 1: that job's
    assert first.asked == ["disk"]
    bridge.detach()                             # phase 2's attach begins; phase 1 never took it
    bridge._act(signal.SIGTERM)                 # a byte the pump reads only now: for the coming job
    assert first.asked == ["disk"]
    bridge.deliver_to(second)
    assert second.asked == ["disk"]             # once, not once per signal and once more for the carry
    bridge.detach()
    bridge.deliver_to(third)                    # the second job's request counts as untaken too ...
    assert third.asked == ["disk"]
    third.asked.clear()
    bridge.detach()
    fourth = _FakeJob()
    bridge.deliver_to(fourth)                   # ... but nothing is asked that no signal asked for
    assert fourth.asked == []
