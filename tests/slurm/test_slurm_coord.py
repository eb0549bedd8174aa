"""The in-job coordinator of a multi-rank Slurm job (runtime/slurmcoord.py), without Slurm daemons
and without torch: its private directory, the refusals, and the agreement over real sockets with
two ranks played by the test (one of them asking for the pause, as a rank's signal handler does)."""
from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from gpuswap.protocol import channel
from gpuswap.runtime import slurm, slurmcoord


def test_private_dir_is_ours_and_0700(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "5", "TMPDIR": str(tmp_path)}
    d = slurmcoord.private_dir(env)
    assert d == tmp_path / "gpuswap-5" and stat.S_IMODE(d.stat().st_mode) == 0o700
    d.chmod(0o755)
    assert stat.S_IMODE(slurmcoord.private_dir(env).stat().st_mode) == 0o700   # ours: made private again
    other = {"SLURM_JOB_ID": "6", "TMPDIR": str(tmp_path)}
    (tmp_path / "gpuswap-6").symlink_to(tmp_path)                 # not a directory of ours: refused
    with pytest.raises(OSError):
        slurmcoord.private_dir(other)
    if os.geteuid() == 0:
        os.mkdir(tmp_path / "gpuswap-8", 0o700)
        os.chown(tmp_path / "gpuswap-8", 65534, 65534)
        with pytest.raises(OSError, match="not a directory owned by"):
            slurmcoord.private_dir({"SLURM_JOB_ID": "8", "TMPDIR": str(tmp_path)})


def test_where_ranks_find_the_coordinator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"SLURM_JOB_ID": "9", "SLURM_SUBMIT_DIR": str(tmp_path), "TMPDIR": str(tmp_path),
            "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}
    cfg = slurm.config_from_env(base)                          # srun --ntasks 2: rank 0's socket
    assert cfg is not None and cfg.control == str(tmp_path / "gpuswap-9" / "step-0.sock")
    cfg = slurm.config_from_env({**base, "GPUSWAP_CONTROL": "/w/sock"})   # under slurm-wrap: the wrapper's
    assert cfg is not None and cfg.control == "/w/sock"
    one = {k: v for k, v in base.items() if not k.startswith("SLURM_PROC") and k != "SLURM_NTASKS"}
    cfg = slurm.config_from_env({**one, "GPUSWAP_CONTROL": "/w/sock"})  # one rank: today's path, no socket
    assert cfg is not None and cfg.control is None
    assert slurm.config_from_env({**base, "SLURM_JOB_NUM_NODES": "2"}) is None   # multi-node: refused
    assert "spans 2 nodes" in capsys.readouterr().err


def _rank(path: Path, rank: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)      # a message that never comes fails the test instead of hanging it
    s.connect(str(path))
    s.sendall(channel.encode({"op": "hello", "pid": os.getpid(), "rank": rank, "world_size": 2, "local_rank": rank}))
    return s


def _expect(lines: dict[int, object], s: socket.socket, rank: int, op: str) -> dict:
    it = lines.setdefault(rank, channel.read_messages(s))
    msg = next(it)   # type: ignore[call-overload]
    assert msg["op"] == op, msg
    return msg


def test_a_preempt_request_stops_both_ranks_at_one_tick_and_commits(tmp_path: Path) -> None:
    killed: list[str] = []
    server = slurmcoord.CoordServer(tmp_path / "c.sock", 60.0, killed.append)
    server.start()
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "c.sock").st_mode) == 0o600
        r0, r1 = _rank(tmp_path / "c.sock", 0), _rank(tmp_path / "c.sock", 1)
        lines: dict[int, object] = {}
        # (both ranks are one process here: the kernel's pid is the same, so the table keeps them apart by rank)
        r1.sendall(channel.encode({"op": "preempt", "signal": "SIGTERM"}))
        e = _expect(lines, r0, 0, "pause")["epoch"]
        assert _expect(lines, r1, 1, "pause")["tier"] == "disk"
        r0.sendall(channel.encode({"op": "mark", "epoch": e, "seen": 7}))
        r1.sendall(channel.encode({"op": "hold", "epoch": e, "tick": 8}))
        assert _expect(lines, r0, 0, "target")["tick"] == 8 and _expect(lines, r1, 1, "target")["tick"] == 8
        r1.sendall(channel.encode({"op": "ready", "epoch": e, "tick": 8}))
        r0.sendall(channel.encode({"op": "ready", "epoch": e, "tick": 8}))
        assert _expect(lines, r0, 0, "park")["tier"] == "disk" and _expect(lines, r1, 1, "park")["tier"] == "disk"
        for r, s in ((0, r0), (1, r1)):
            s.sendall(channel.encode({"op": "part", "epoch": e, "file": f"ckpt-000001.r{r}.pt", "bytes": 10,
                                      "sha256": "0" * 64, "seconds": 0.1}))
        commit = _expect(lines, r0, 0, "commit")
        assert [p["rank"] for p in commit["parts"]] == [0, 1] and commit["tick"] == 8
        assert not server.committed.is_set()
        r0.sendall(channel.encode({"op": "committed", "epoch": e, "seq": 1, "path": "/x/ckpt-000001.json",
                                   "bytes": 20}))
        assert _expect(lines, r0, 0, "exit")["epoch"] == e and _expect(lines, r1, 1, "exit")["epoch"] == e
        assert server.committed.wait(30) and not killed
    finally:
        server.close()
    assert not (tmp_path / "c.sock").exists()
