"""On a shared server, a user sees nothing of another's jobs: files, control sockets, working
directories (issue 10, items 3-5). Two real ordinary users (made with useradd) act through forked
children that switch to their uid, so the kernel and the daemon see their real credentials."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpuswap_testing import AsUser, Daemon, ensure_user, train_cmd

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create and act as second and third users")

SECRET = "alice-secret-7f3a"
PATH_ENV = {"PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="module")
def alice() -> AsUser:
    return AsUser(*ensure_user("gs-alice"))


@pytest.fixture(scope="module")
def bob() -> AsUser:
    return AsUser(*ensure_user("gs-bob"))


def _wait_for(pred, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _try_read(paths: list[str], dirs: list[str]) -> dict[str, object]:
    """What a user gets trying to read each file and list each directory: 'READ'/'LISTED' or errno."""
    out: dict[str, object] = {}
    for p in paths:
        try:
            with open(p, "rb") as f:
                f.read()
            out[p] = "READ"
        except OSError as e:
            out[p] = e.errno
    for d in dirs:
        try:
            os.listdir(d)
            out[d] = "LISTED"
        except OSError as e:
            out[d] = e.errno
    return out


def _connect(path: str) -> object:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return "CONNECTED"
    except OSError as e:
        return e.errno
    finally:
        s.close()


def _assert_private(home: Path, owner_uid: int) -> None:
    """Nothing under the home is readable by group or others, whatever the umask; what a job's
    owner may use is theirs, everything else the daemon's."""
    for root, dirs, files in os.walk(home):
        rel = Path(root).relative_to(home)
        if rel == Path(".") and "simulated-driver" in dirs:
            # The simulated GPUs' own state, not the daemon's: every user's CUDA processes register
            # there and read their driver state, as any user can ask NVML about a pid. Neither of
            # its folders can be listed, and nobody but root writes the driver's records.
            dirs.remove("simulated-driver")
            sim = home / "simulated-driver"
            assert (os.stat(sim).st_mode & 0o7777, os.stat(sim / "procs").st_mode & 0o7777,
                    os.stat(sim / "driver").st_mode & 0o7777) == (0o711, 0o1733, 0o711)
        if rel.name == "ckpt":
            dirs[:] = []      # the job's own files: protected by the directory's 0700, whatever their mode
            continue
        for d in dirs:
            st = os.lstat(Path(root) / d)
            assert st.st_mode & 0o066 == 0, (rel / d, oct(st.st_mode))
            want = owner_uid if d == "ckpt" else 0
            assert st.st_uid == want, (rel / d, st.st_uid)
        for f in files:
            if rel == Path(".") and f in ("gpuswap.sock", "daemon.out"):   # the API socket; the test's own log
                continue
            st = os.lstat(Path(root) / f)
            assert st.st_mode & 0o077 == 0, (rel / f, oct(st.st_mode))
            want = owner_uid if f in ("output.log", "control") else 0
            assert st.st_uid == want, (rel / f, st.st_uid)


def test_another_user_cannot_read_a_jobs_environment_output_or_checkpoint(make_daemon, home, alice, bob):
    old = os.umask(0)                        # the daemon runs under the loosest umask there is
    try:
        make_daemon()
    finally:
        os.umask(old)
    script = ('echo "out: $ALICE_SECRET"; umask 000; echo "$ALICE_SECRET" > "$GPUSWAP_CKPT_DIR/ckpt-000001.pt"; '
              'touch "$GPUSWAP_CKPT_DIR/ready"; sleep 600')
    code, out, err = alice.cli(home, "submit", "--json", "--", "sh", "-c", script, env={"ALICE_SECRET": SECRET})
    assert code == 0, err
    job = json.loads(out)["id"]
    jd = home / "jobs" / str(job)
    _wait_for(lambda: (jd / "ckpt" / "ready").exists(), "the job's checkpoint file")
    files = [home / "state.db", home / "state.db-wal", jd / "run-1" / "spec.json", jd / "run-1" / "status.json",
             jd / "run-1" / "supervisor.log", jd / "output.log", jd / "ckpt" / "ckpt-000001.pt"]
    files = [str(p) for p in files if p.exists()]
    assert len(files) >= 5
    dirs = [str(home), str(home / "jobs"), str(jd), str(jd / "run-1"), str(jd / "ckpt")]
    got = bob.call(lambda: _try_read(files, dirs))
    assert got == {p: errno.EACCES for p in files + dirs}, got
    assert bob.call(lambda: _connect(str(jd / "run-1" / "control"))) == errno.EACCES
    # bob still uses the CLI (the API socket is everyone's), and sees nothing of alice's job
    code, out, err = bob.cli(home, "ls", "--json")
    assert code == 0 and json.loads(out) == [], (code, out, err)
    assert bob.cli(home, "logs", str(job))[0] == 1
    # alice uses hers: through the CLI, and her own files directly
    code, out, err = alice.cli(home, "logs", str(job))
    assert code == 0 and f"out: {SECRET}" in out, (code, out, err)
    assert alice.call(lambda: open(str(jd / "ckpt" / "ckpt-000001.pt")).read()) == SECRET + "\n"
    assert alice.call(lambda: open(str(jd / "output.log")).read()) == f"out: {SECRET}\n"
    _assert_private(home, alice.uid)
    code, _, err = alice.cli(home, "cancel", str(job))
    assert code == 0, err


def test_a_loose_home_from_an_older_version_is_tightened_at_start(make_daemon, home, alice, bob):
    daemon = make_daemon()
    code, out, err = alice.cli(home, "submit", "--json", "--", "sh", "-c",
                               'echo "$ALICE_SECRET"; echo "$ALICE_SECRET" > "$GPUSWAP_CKPT_DIR/c.pt"; exit 3',
                               env={"ALICE_SECRET": SECRET})
    job = json.loads(out)["id"]
    daemon.state(job, "FAILED")
    daemon.stop()
    for root, dirs, files in os.walk(home):      # what an older version left: 0755 and 0644 everywhere
        for d in dirs:
            os.chmod(Path(root) / d, 0o755)
        for f in files:
            if not (Path(root) / f).is_socket():
                os.chmod(Path(root) / f, 0o644)
    os.chmod(home, 0o755)
    jd = home / "jobs" / str(job)
    files = [str(home / "state.db"), str(jd / "run-1" / "spec.json"), str(jd / "output.log"), str(jd / "ckpt" / "c.pt")]
    assert bob.call(lambda: _try_read(files, [])) == {p: "READ" for p in files}    # the premise
    daemon.start()
    assert bob.call(lambda: _try_read(files, [str(home)])) == {p: errno.EACCES for p in files + [str(home)]}
    _assert_private(home, alice.uid)
    assert alice.call(lambda: open(str(jd / "ckpt" / "c.pt")).read()) == SECRET + "\n"
    assert bob.cli(home, "ls", "--json")[0] == 0


def test_a_home_the_daemon_cannot_make_private_is_refused_with_one_line(home, alice):
    theirs = home / "theirs"
    theirs.mkdir()
    os.chown(theirs, alice.uid, alice.gid)
    too_long = home / ("d" * (107 - len(str(home)) - len("/gpuswap.sock")))
    for where, why in ((theirs, f"belongs to uid {alice.uid}"), (too_long / "x", "too long")):
        r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1x1GiB"],
                           env=dict(os.environ, GPUSWAP_HOME=str(where)), capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and why in r.stderr and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
        assert "Traceback" not in r.stderr


def _old_control_name(home: Path, job_id: int, generation: int) -> str:
    """The abstract socket name the daemon used to give a job: predictable by anyone."""
    tag = hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:12]
    return f"\0gpuswap/{tag}/{job_id}/{generation}"


def _squat(home: str, names: list[str], paths: list[str]) -> list[object]:
    """Bind every name we can (and keep them bound: this child sleeps), report what happened."""
    got: list[object] = []
    held = []
    for addr in names + paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(addr)
            s.listen(1)
            held.append(s)
            got.append("BOUND")
        except OSError as e:
            got.append(e.errno)
    return got


def test_control_sockets_cannot_be_squatted_or_reached_by_another_user(daemon, home, alice, bob):
    """bob binds, ahead of time, every name alice's next jobs' control sockets could have (the
    predictable abstract names, and their paths in the home): alice's jobs run all the same, and
    only she reaches her job's socket."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:          # bob, holding his sockets for the whole test
        os.close(r)
        os.setgroups([])
        os.setgid(bob.gid)
        os.setuid(bob.uid)
        names = [_old_control_name(home, j, g) for j in range(1, 6) for g in (1, 2)]
        paths = [str(home / "jobs" / str(j) / "run-1" / "control") for j in range(1, 6)]
        os.write(w, json.dumps(_squat(str(home), names, paths)).encode())
        os.close(w)
        time.sleep(600)
        os._exit(0)
    os.close(w)
    try:
        got = json.loads(os.read(r, 65536))
        assert set(got[-5:]) <= {errno.ENOENT, errno.EACCES}, got      # no path in the home is bob's to take
        code, out, err = alice.cli(home, "submit", "--json", "--", "sh", "-c",
                                   'echo "$GPUSWAP_CONTROL"; touch "$GPUSWAP_CKPT_DIR/x"; sleep 600')
        assert code == 0, err
        job = json.loads(out)["id"]
        daemon.state(job, "RUNNING")
        control = home / "jobs" / str(job) / "run-1" / "control"
        _wait_for(lambda: control.is_socket() and os.stat(control).st_uid == alice.uid, "the control socket")
        # the echo reaches the log some time after the socket exists (a loaded machine: seconds)
        _wait_for(lambda: daemon.cli("logs", str(job)).stdout.strip(), "the job's first line in its log")
        assert daemon.cli("logs", str(job)).stdout.strip() == str(control)
        assert bob.call(lambda: _connect(str(control))) == errno.EACCES
        # alice (the job's owner) reaches it and is accepted: her hello marks the runtime attached
        def hello() -> bool:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(control))
            s.sendall(b'{"op": "hello", "pid": 1, "device_bytes": 0}\n')
            time.sleep(0.2)
            s.close()
            return True
        assert alice.call(hello) is True
        assert daemon.until(job, lambda j: j["runtime_attached"])["state"] == "RUNNING"
        daemon.cli("cancel", str(job))
        daemon.state(job, "CANCELLED")
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_failed_job_keeps_its_checkpoint_a_completed_one_drops_it(daemon, home, alice):
    ids = {}
    for code in (0, 3):
        rc, out, err = alice.cli(home, "submit", "--json", "--", "sh", "-c",
                                 f'echo step > "$GPUSWAP_CKPT_DIR/ckpt-000001.pt"; exit {code}')
        assert rc == 0, err
        ids[code] = json.loads(out)["id"]
    daemon.state(ids[0], "COMPLETED")
    daemon.state(ids[3], "FAILED")
    assert not (home / "jobs" / str(ids[0]) / "ckpt").exists()
    kept = home / "jobs" / str(ids[3]) / "ckpt" / "ckpt-000001.pt"
    assert kept.read_text() == "step\n"
    assert alice.call(lambda: open(str(kept)).read()) == "step\n"     # hers to recover


def test_a_home_near_the_socket_path_limit_still_reaches_its_control_sockets(home):
    """The API socket fits sun_path exactly; the jobs' control sockets, deeper, do not: they are
    bound and reached through their directory's fd. A real runtime attaches and parks nothing."""
    long_home = home / ("h" * (107 - len(str(home)) - len("/gpuswap.sock") - 1))
    assert len(str(long_home / "gpuswap.sock")) == 107
    long_home.mkdir()
    d = Daemon(long_home, ["--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--max-switch-fraction", "1", "--no-calibrate"])
    try:
        d.start()
        job = d.submit(train_cmd(home / "out.json", 20, 0.05))
        assert len(str(long_home / "jobs" / str(job) / "run-1" / "control")) > 107
        j = d.state(job, "COMPLETED", timeout=120)
        assert j["runtime_attached"], j
        assert "unavailable" not in d.cli("logs", str(job)).stdout + d.cli("logs", str(job)).stderr
    finally:
        d.stop()
        subprocess.run(["pkill", "-9", "-f", str(long_home)], check=False)


def test_a_working_directory_the_user_cannot_enter_is_refused_and_never_entered_as_root(daemon, home, alice):
    parent = Path(tempfile.mkdtemp(dir="/tmp", prefix="gs-rootonly-"))
    try:
        sub = parent / "data"
        sub.mkdir()
        (sub / "data.txt").write_text("root-only-secret\n")
        sub.chmod(0o755)
        (sub / "data.txt").chmod(0o644)
        parent.chmod(0o700)
        body = {"argv": ["cat", "data.txt"], "cwd": str(sub), "env": PATH_ENV}
        code, rec = alice.api(home, "POST", "/v1/jobs", body)
        assert code == 400 and str(sub) in rec["detail"] and "Permission denied" in rec["detail"], (code, rec)
        code, rec = alice.api(home, "POST", "/v1/jobs", {**body, "cwd": str(parent / "nope")})
        assert code == 400, (code, rec)
        # The check passed at submit, and the directory closed before the start: the job still
        # enters it only as alice.
        parent.chmod(0o755)
        blocker = daemon.submit(["sleep", "600"])
        daemon.state(blocker, "RUNNING")
        code, rec = alice.api(home, "POST", "/v1/jobs", body)
        assert code == 201, rec
        parent.chmod(0o700)
        daemon.cli("cancel", str(blocker))
        j = daemon.state(rec["id"], "FAILED")
        assert "working directory" in j["reason"] and "Permission denied" in j["reason"], j["reason"]
        assert "root-only-secret" not in daemon.cli("logs", str(rec["id"])).stdout
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_the_job_runs_in_its_directory_as_its_user(daemon, home, alice):
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="gs-alice-"))
    try:
        os.chown(work, alice.uid, alice.gid)
        work.chmod(0o700)                   # alice's alone: root enters it, and so must she
        code, rec = alice.api(home, "POST", "/v1/jobs", {"argv": ["sh", "-c", "pwd; id -u; echo x > made"],
                                                         "cwd": str(work), "env": PATH_ENV})
        assert code == 201, rec
        daemon.state(rec["id"], "COMPLETED")
        assert daemon.cli("logs", str(rec["id"])).stdout.split() == [str(work), str(alice.uid)]
        assert os.stat(work / "made").st_uid == alice.uid
        assert stat.S_IMODE(os.stat(work).st_mode) == 0o700
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_home_not_open_to_a_user_is_said_to_be_so_not_that_no_daemon_listens(tmp_path, alice):
    """A daemon home of mode 700 (or a socket of 600) refused another user's connect with EACCES,
    and the CLI said "no gpuswap daemon is listening" (69, and `wait` redialled for two minutes)."""
    home = tmp_path / "closed"
    home.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # something does listen there
    listener.bind(str(home / "gpuswap.sock"))
    listener.listen()
    try:
        code, out, err = alice.cli(home, "ls")
    finally:
        listener.close()
    assert code == 1 and out == "", (code, out, err)
    assert err == (f"gpuswap: permission denied on {home / 'gpuswap.sock'}: the daemon's home or socket is not "
                   "open to you (ask its admin, or set GPUSWAP_HOME to your own)\n"), err
