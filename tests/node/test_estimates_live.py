"""Runtime estimates in the daemon: `submit --time`, the estimate made at submission from the
user's finished runs, what `show` says about it, and that the policy's snapshot carries it."""
from __future__ import annotations

import json
import os
import pwd
import re
import sqlite3
import time

from gpuswap.node import snapshot
from gpuswap.node.store import NewJob, Store


def _show(daemon, job_id: int) -> tuple[dict, str]:
    r = daemon.cli("show", str(job_id), "--json")
    assert r.returncode == 0, r.stderr
    text = daemon.cli("show", str(job_id))
    assert text.returncode == 0, text.stderr
    return json.loads(r.stdout), text.stdout


def _submit(daemon, *args: str) -> int:
    r = daemon.cli("submit", "--json", *args)
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout)["id"])


def test_submit_time_and_estimates_from_earlier_runs_show_where_they_came_from(daemon):
    user = pwd.getpwuid(os.geteuid()).pw_name
    first = _submit(daemon, "--name", "fam", "--time", "4h", "--", "sleep", "0.5")
    rec, text = _show(daemon, first)
    assert (rec["time_limit_s"], rec["estimate_s"], rec["estimate_from"]) == (14400.0, 14400.0, "time")
    assert rec["estimate"] == "4h from --time" and "4h from --time" in text
    assert daemon.cli("wait", str(first), "--timeout", "120").returncode == 0
    listed = _ls_left(daemon)
    assert listed[first] == "-", listed                  # ended: nothing left to say

    second = _submit(daemon, "--name", "fam", "--", "sleep", "0.5")     # no --time: learnt from the first
    rec, text = _show(daemon, second)
    ran = daemon.job(first)["run_s"]
    assert ran > 0
    assert (rec["time_limit_s"], rec["estimate_s"], rec["estimate_from"], rec["estimate_runs"]) == (None, ran, "name", 1)
    assert rec["estimate"].endswith(f"from 1 earlier run of {user}/fam") and f"1 earlier run of {user}/fam" in text
    assert daemon.cli("wait", str(second), "--timeout", "120").returncode == 0

    held = _submit(daemon, "--name", "long", "--time", "3h", "--", "sleep", "600")
    daemon.state(held, "RUNNING")
    left = _ls_left(daemon)[held]                        # `ls` LEFT: 3h less what it has run
    ran = daemon.job(held)["run_s"]                      # since: no less than when `ls` looked
    assert left == "3h" or re.fullmatch(r"2h \d\dm", left), left
    shown = 3 * 3600 if left == "3h" else 2 * 3600 + int(left[3:5]) * 60
    assert 3 * 3600 - ran - 60 <= shown <= 3 * 3600, (left, ran)
    assert daemon.cli("cancel", str(held)).returncode == 0

    other = _submit(daemon, "--name", "new", "--", "true")               # a new name: the user's runs
    rec, _ = _show(daemon, other)
    assert (rec["estimate_from"], rec["estimate_runs"]) == ("user", 2)
    assert rec["estimate"].endswith(f"from 2 earlier runs of {user}")
    assert daemon.cli("wait", str(other), "--timeout", "120").returncode == 0


def _ls_left(daemon) -> dict[int, str]:
    """`gpuswap ls`' LEFT column, per job id (read by the header's column positions)."""
    r = daemon.cli("ls")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    header = next(i for i, ln in enumerate(lines) if ln.startswith("ID"))
    at, end = lines[header].index("LEFT"), lines[header].index("REASON")
    return {int(ln.split()[0]): ln[at:end].strip() for ln in lines[header + 1:]
            if ln[:1].isdigit()}                    # not a wrapped reason's next line


def test_an_ended_job_has_its_final_run_time_when_wait_returns(daemon):
    """A job's run time is written before its end is: one that exits between two of the
    controller's ticks ran in that interval too (it used to be counted as 0 s, or counted after
    `wait` had returned, so the next submission's estimate did not see it)."""
    quick = _submit(daemon, "--name", "quick", "--", "true")
    assert daemon.cli("wait", str(quick), "--timeout", "120").returncode == 0
    ran = daemon.job(quick)["run_s"]
    assert ran > 0
    later = _submit(daemon, "--name", "quick", "--", "true")
    rec, _ = _show(daemon, later)
    assert (rec["estimate_s"], rec["estimate_from"], rec["estimate_runs"]) == (ran, "name", 1)
    assert daemon.cli("wait", str(later), "--timeout", "120").returncode == 0
    assert daemon.job(quick)["run_s"] == ran            # nothing was added after it was reported ended


def test_a_job_with_nothing_to_learn_from_has_no_estimate(daemon):
    job = _submit(daemon, "--name", "alone", "--", "true")
    rec, text = _show(daemon, job)
    assert (rec["estimate_s"], rec["estimate_from"], rec["estimate"]) == (None, None, "none")
    assert any(line.split()[:2] == ["estimate", "none"] for line in text.splitlines())


def test_bad_time_values_exit_64_with_one_line(daemon):
    for bad in ("0", "banana", "-5", "400d", "1:2:3:4"):
        r = daemon.cli("submit", "--time", bad, "--", "true")
        assert r.returncode == 64, (bad, r)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and "time" in r.stderr, r.stderr
    assert daemon.client.get("/v1/jobs") == []                           # nothing was queued


def test_the_policy_snapshot_carries_the_stored_estimate(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        [a, b] = store.add_jobs([
            NewJob(name="x", user="u", uid=1, gid=1, argv=["true"], cwd="/", env={}, priority=1, gpus=1,
                   mem_bytes=0, time_limit_s=600.0, estimate_s=600.0, estimate_from="time"),
            NewJob(name="y", user="u", uid=1, gid=1, argv=["true"], cwd="/", env={}, priority=1, gpus=1,
                   mem_bytes=0)], 1.0)
        assert snapshot.job_view(store.get(a)).estimate_s == 600.0
        assert snapshot.job_view(store.get(b)).estimate_s is None
    finally:
        store.close()


def test_a_family_keeps_its_estimate_after_the_retention_sweep_forgets_its_runs(make_daemon):
    """The sweep keeps each family's newest completed runs (`kept_runs`, KEPT_RUNS of them): a
    family that runs less often than the retention period keeps its estimate. A failed run is not
    kept, as it never counted."""
    from gpuswap.node.store import KEPT_RUNS
    from gpuswap.policy.estimate import FROM_NAME, from_runs

    daemon = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--retention", "2s")
    ids = []
    for argv in [["true"]] * (KEPT_RUNS + 1) + [["false"]]:
        job = _submit(daemon, "--name", "monthly", "--", *argv)
        daemon.cli("wait", str(job), "--timeout", "120")    # ended (or already forgotten: 2 s on)
        ids.append(job)
    deadline = time.monotonic() + 120
    while _any_left(daemon, ids):
        assert time.monotonic() < deadline, "the sweep never forgot the finished jobs"
        time.sleep(0.2)
    db = sqlite3.connect(daemon.home / "state.db")
    try:
        assert db.execute(f"SELECT COUNT(*) FROM jobs WHERE id IN ({','.join(map(str, ids))})").fetchone()[0] == 0
        kept = db.execute("SELECT job_id, run_s FROM kept_runs ORDER BY end_time").fetchall()
    finally:
        db.close()
    # The newest completed ones, oldest first; neither the oldest completed nor the failed one.
    assert [job_id for job_id, _ in kept] == ids[1:KEPT_RUNS + 1], kept
    assert all(run_s > 0 for _, run_s in kept), kept
    later = _submit(daemon, "--name", "monthly", "--", "sleep", "600")
    rec, _ = _show(daemon, later)
    expected = from_runs([run_s for _, run_s in kept], FROM_NAME)
    assert (rec["estimate_from"], rec["estimate_runs"], rec["estimate_s"]) == (FROM_NAME, KEPT_RUNS, expected.seconds)
    assert daemon.cli("cancel", str(later)).returncode == 0


def _any_left(daemon, ids: list[int]) -> bool:
    """Whether the daemon still has a record of any of `ids` (a forgotten job is a 404)."""
    from gpuswap.api.client import ClientError

    for job_id in ids:
        try:
            daemon.client.get(f"/v1/jobs/{job_id}")
            return True
        except ClientError as e:
            assert "404" in str(e) or "no job" in str(e).lower(), e
    return False
