"""The first program of every job: become the user, then enter the job's directory, then exec.

Why a separate program: `subprocess.Popen(cwd=..., user=...)` enters the directory *before* it
drops privileges (CPython's child does chdir, then setgroups/setgid/setuid), so a root-launched
job could start in a directory its user may not enter. Here the order is: groups, gid, uid,
parent-death signal, chdir, exec; every check the kernel makes after the switch is made as the user.
The supervisor is threaded, so this cannot be a `preexec_fn`; it is a fresh single-threaded
process instead.

Run by the supervisor as `python -I -S execshim.py CONFIG_FD STATUS_FD PARENT_PID`, with an empty
environment (it runs as root until the switch: nothing of the user's environment may reach the
interpreter). It reads one JSON object from CONFIG_FD: {"argv", "cwd", "env", "uid", "gid",
"groups"} (uid null: stay who we are). On success the exec closes STATUS_FD (close-on-exec) and
the supervisor reads nothing; on failure it writes {"stage": "chdir"|"exec"|"credentials",
"errno", "message"} there and exits 127. If the config never comes (the supervisor died before
recording the job's pid) it starts nothing. Standard library only: it runs with `-I -S`.
"""
import ctypes
import json
import os
import signal
import sys
import warnings  # noqa: F401  imported lazily by os.execvpe: load it while the stdlib is readable


PR_SET_PDEATHSIG = 1


def _fail(status_fd: int, stage: str, err: Exception) -> None:
    msg = {"stage": stage, "errno": getattr(err, "errno", None),
           "message": getattr(err, "strerror", None) or str(err)}
    try:
        os.write(status_fd, json.dumps(msg).encode())
    finally:
        os._exit(127)


def main() -> None:
    config_fd, status_fd, parent = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.set_inheritable(status_fd, False)
    chunks = []
    while True:
        chunk = os.read(config_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(config_fd)
    try:
        cfg = json.loads(b"".join(chunks))
    except ValueError:
        os._exit(127)           # no complete config: the supervisor died before sending it
    try:
        if cfg.get("uid") is not None:
            os.setgroups(cfg.get("groups") or [])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        # After the switch: a credential change clears the parent-death signal.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except OSError as e:
        _fail(status_fd, "credentials", e)
    if os.getppid() != parent:  # the supervisor died before the signal was armed
        os._exit(127)
    try:
        os.chdir(cfg["cwd"])
    except (OSError, ValueError) as e:
        _fail(status_fd, "chdir", e)
    # Python ignores these at startup, and an ignored signal stays ignored across exec: the job
    # gets the defaults a shell would give it (as Popen's restore_signals does).
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvpe(cfg["argv"][0], cfg["argv"], cfg["env"])
    except Exception as e:   # OSError; ValueError: a NUL byte or an unencodable string in argv or env
        _fail(status_fd, "exec", e)


if __name__ == "__main__":
    main()
