"""A real daemon runs real job processes: exit codes, signals, logs, bad commands, records."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuswap.api.client import ClientError
from gpuswap_testing import Gate, forever


def test_submit_wait_exit_code_and_logs(daemon):
    r = daemon.cli("submit", "--name", "hello", "--json", "--", "sh", "-c", "echo out-line; echo err-line >&2; exit 3")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    w = daemon.cli("wait", str(job_id), "--timeout", "30")
    assert w.returncode == 3
    logs = daemon.cli("logs", str(job_id))
    assert "out-line" in logs.stdout and "err-line" in logs.stdout
    show = json.loads(daemon.cli("show", str(job_id), "--json").stdout)
    for key in ("id", "name", "state", "priority", "gpus", "exit_code", "reason", "parked", "parked_bytes", "events"):
        assert key in show
    assert show["state"] == "FAILED" and show["exit_code"] == 3 and show["parked"] is None
    assert [e["state"] for e in show["events"]] == ["PENDING", "RUNNING", "FAILED"]
    assert all({"time", "state", "reason"} <= set(e) for e in show["events"])


def test_job_environment(daemon):
    job_id = daemon.submit(["sh", "-c", "env | grep -E '^(CUDA_|GPUSWAP_)' | sort"], name="env")
    daemon.state(job_id, "COMPLETED")
    out = daemon.cli("logs", str(job_id)).stdout
    assert "CUDA_VISIBLE_DEVICES=0" in out
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in out
    assert f"GPUSWAP_JOB_ID={job_id}" in out
    assert f"GPUSWAP_CONTROL={daemon.home}/jobs/{job_id}/run-1/control" in out
    assert "GPUSWAP_SIMULATED_GPU=1" in out


def test_killed_by_signal_uses_128_plus_n(daemon):
    job_id = daemon.submit(["sh", "-c", "kill -9 $$"])
    j = daemon.state(job_id, "FAILED")
    assert j["exit_code"] == 137 and j["signal"] == 9
    assert "SIGKILL" in j["reason"]


def test_command_that_cannot_start_fails_and_daemon_carries_on(daemon):
    bad = daemon.submit(["/nonexistent/program"])
    j = daemon.state(bad, "FAILED")
    assert "cannot start" in j["reason"] and "No such file" in j["reason"]
    good = daemon.submit(["true"])
    assert daemon.state(good, "COMPLETED")["exit_code"] == 0


def test_cancel_running_and_pending(daemon):
    running = daemon.submit(forever(daemon.home))
    daemon.state(running, "RUNNING")
    pending = daemon.submit(forever(daemon.home))   # one simulated GPU: waits
    assert daemon.job(pending)["state"] == "PENDING"
    assert daemon.cli("cancel", str(pending)).returncode == 0
    assert daemon.state(pending, "CANCELLED")
    assert daemon.cli("cancel", str(running)).returncode == 0
    j = daemon.state(running, "CANCELLED", timeout=20)
    assert j["exit_code"] == 128 + 15
    assert daemon.cli("cancel", str(running)).returncode == 1   # already ended: a failure, one line


def test_gpus_say_simulated(daemon):
    r = daemon.cli("gpus")
    assert r.returncode == 0 and "SIMULATED" in r.stdout
    info = json.loads(daemon.cli("gpus", "--json").stdout)
    assert info["simulated"] is True and all(g["simulated"] for g in info["gpus"])


def test_cli_exit_codes(daemon, tmp_path):
    assert daemon.cli("submit").returncode == 64                    # no command
    assert daemon.cli("submit", "--mem", "lots", "--", "true").returncode == 64
    assert daemon.cli("submit", "--gpus", "5", "--", "true").returncode == 64
    assert daemon.cli("frobnicate").returncode == 64
    r = daemon.cli("show", "999")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    w = daemon.submit(forever(daemon.home))
    assert daemon.cli("wait", str(w), "--timeout", "0.5").returncode == 124
    daemon.cli("cancel", str(w))


def test_daemon_unavailable_is_69(tmp_path):
    import os
    import subprocess

    env = dict(os.environ, GPUSWAP_HOME=str(tmp_path / "nothing"))
    r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "ls"], env=env, capture_output=True, text=True)
    assert r.returncode == 69 and "no gpuswap daemon" in r.stderr and "Traceback" not in r.stderr


def test_one_daemon_per_home(daemon):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1"],
                       env=daemon.env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and "already serves" in r.stderr
    assert daemon.client.get("/v1/health")["ok"]


def test_logs_follow_streams_until_the_job_ends(daemon, home):
    """`logs -f` shows lines of a job that is still running (the job holds until the test has read
    them from the follower), then the rest, and exits when the job ends."""
    gate = Gate(home / "go")
    job = daemon.submit(gate.hold(before="print('line-1', flush=True); print('line-2', flush=True)",
                                  then="for i in (3, 4, 5): print(f'line-{i}', flush=True)"))
    daemon.state(job, "RUNNING")
    follow = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "logs", str(job), "-f"],
                              env=daemon.env, stdout=subprocess.PIPE, text=True)
    early = []
    while "line-2" not in "".join(early):
        line = follow.stdout.readline()
        assert line, f"logs -f ended before the job did: {early}"
        early.append(line)
    assert daemon.job(job)["state"] == "RUNNING"
    gate.open()
    rest, _ = follow.communicate(timeout=180)
    assert follow.returncode == 0
    lines = [l for l in ("".join(early) + rest).split() if l.startswith("line-")]
    assert lines == [f"line-{i}" for i in range(1, 6)]
    assert daemon.job(job)["state"] == "COMPLETED"


def test_markup_in_user_strings_is_shown_verbatim(daemon):
    """Names, commands, users and reasons are the user's text: rich markup in them is neither
    parsed (a "[/x]" used to crash ls with a MarkupError) nor applied ("[bold]")."""
    odd = daemon.submit(["sh", "-c", "echo '[red]x[/red]'"], name="[/x]")
    bold = daemon.submit(["true"], name="[bold]loud[/bold]")
    missing = daemon.submit(["/nonexistent/[/y]"], name="m")
    daemon.state(odd, "COMPLETED")
    daemon.state(bold, "COMPLETED")
    daemon.state(missing, "FAILED")
    ls = daemon.cli("ls")
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, ls.stderr
    assert "[/x]" in ls.stdout and "[bold]loud[/bold]" in ls.stdout and "[/y]" in ls.stdout
    show = daemon.cli("show", str(odd))
    assert show.returncode == 0 and "Traceback" not in show.stderr, show.stderr
    assert "[/x]" in show.stdout and """sh -c 'echo '"'"'[red]x[/red]'"'"''""" in show.stdout   # shlex.join
    show = daemon.cli("show", str(missing))
    assert show.returncode == 0 and "cannot start '/nonexistent/[/y]'" in show.stdout
    blocker = daemon.submit(forever(daemon.home), name="[/z]")
    daemon.state(blocker, "RUNNING")
    gpus = daemon.cli("gpus")
    assert gpus.returncode == 0 and "[/z]" in gpus.stdout, gpus.stderr
    daemon.cli("cancel", str(blocker))


def test_ls_and_show_say_the_gpus_are_simulated(daemon):
    job = daemon.submit(forever(daemon.home), name="sim")
    daemon.state(job, "RUNNING")
    ls = daemon.cli("ls")
    assert ls.returncode == 0 and "SIMULATED" in ls.stdout and "[sim 0]" in ls.stdout
    show = daemon.cli("show", str(job))
    assert "assigned 0 (SIMULATED GPUs" in show.stdout
    assert all(j["gpus_simulated"] is True for j in json.loads(daemon.cli("ls", "--json").stdout))
    assert json.loads(daemon.cli("show", str(job), "--json").stdout)["gpus_simulated"] is True
    daemon.cli("cancel", str(job))


BAD_SERVER_OPTIONS = [
    (["--policy", "bogus"], "is not a policy"),
    (["--policy", "srtf-oracle"], "simulator"),
    (["--simulate-gpus", "2x0"], "no memory"),
    (["--simulate-gpus", "zz"], "--simulate-gpus"),
    (["--min-runtime", "-5"], "--min-runtime"),
    (["--pause-timeout", "-1"], "--pause-timeout"),
    (["--pause-timeout", "nan"], "--pause-timeout"),
    (["--ram-budget", "lots"], "--ram-budget"),
]


@pytest.mark.parametrize("args,says", BAD_SERVER_OPTIONS)
def test_server_refuses_bad_options_at_start(tmp_path, args, says):
    """One line, exit 64, before the daemon touches its home (no daemon that then fails forever)."""
    home = tmp_path / "home"
    env = dict(os.environ, GPUSWAP_HOME=str(home))
    base = [] if "--simulate-gpus" in args else ["--simulate-gpus", "1"]
    r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", *base, *args], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and says in r.stderr, r.stderr
    assert not home.exists()


def test_unusable_home_is_one_line_and_exit_1():
    env = dict(os.environ, GPUSWAP_HOME="/proc/forbidden")
    r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1"], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "/proc/forbidden" in r.stderr and "state directory" in r.stderr


@pytest.mark.parametrize("timeout", ["-1", "nan", "inf", "soon"])
def test_wait_with_a_bad_timeout_is_a_usage_error(daemon, timeout):
    r = daemon.cli("wait", "1", "--timeout", timeout)
    assert r.returncode == 64 and "--timeout" in r.stderr and "Traceback" not in r.stderr


def test_refused_pause_exits_1(daemon):
    """A driver-frozen job has no disk tier: the refusal is reported and is a failure."""
    job = daemon.submit(forever(daemon.home), pause_mode="transparent")
    daemon.state(job, "RUNNING")
    r = daemon.cli("pause", str(job), "--to", "disk")
    assert r.returncode == 1 and "refused" in r.stderr and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
    assert daemon.job(job)["state"] == "RUNNING"
    daemon.cli("cancel", str(job))


def test_missing_working_directory_is_refused_at_submit_or_blamed_not_the_command(daemon, tmp_path):
    gone = tmp_path / "gone"
    body = {"argv": ["true"], "cwd": str(gone), "env": daemon.env}
    with pytest.raises(ClientError) as refused:            # absent at submit: a clear 400 (CLI exit 64)
        daemon.client.post("/v1/jobs", body)
    assert refused.value.exit_code == 64 and str(gone) in str(refused.value), refused.value
    gone.mkdir()                                           # there at submit, gone at the start
    blocker = daemon.submit(forever(daemon.home))
    daemon.state(blocker, "RUNNING")
    job = int(daemon.client.post("/v1/jobs", body)["id"])
    gone.rmdir()
    daemon.cli("cancel", str(blocker))
    j = daemon.state(job, "FAILED")
    assert "working directory" in j["reason"] and str(gone) in j["reason"], j["reason"]
