"""Other users' words reach an admin's terminal as text, and listings go by uid, not by name.

* A job's name is a label others see in listings: control characters in it are refused at submit.
  A command may hold them (a script's argument); every view shows them escaped, never sent.
* Listings (`ls`, /v1/jobs, the overview's finished jobs, tokens) filter by the caller's uid, as
  `show` does: an account deleted and made again under the same name (another uid) is not the
  first one, and must not list its jobs, argv and all.
"""
from __future__ import annotations

import os
import sqlite3

import pytest

from gpuswap.node.store import NewJob, Store
from gpuswap.printable import printable
from gpuswap_testing import AsUser, forever

ESC_NAME = "x\x1b]0;PWNED\x07\x1b[2J\x1b[31mevil"


def test_printable_escapes_control_and_bidi_characters_and_leaves_text_alone():
    assert printable("train-é-日本 [bold]x[/]") == "train-é-日本 [bold]x[/]"
    assert printable("a\x1b[2Jb\nc\td\x9b\x7f\u202eabc") == "a\\x1b[2Jb\\nc\\td\\x9b\\x7f\\u202eabc"


def test_a_name_with_control_characters_is_refused_and_a_command_with_them_is_shown_escaped(make_daemon):
    daemon = make_daemon()
    r = daemon.cli("submit", "--name", ESC_NAME, "--", "true")
    assert r.returncode == 64 and "control characters" in r.stderr, r
    assert "\x1b" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    job = daemon.submit(forever(daemon.home, "echo '\x1b]0;PWNED\x07\x1b[2J'"), name="plain")
    daemon.state(job, "RUNNING")
    for args in (("ls",), ("ls", "--all-users"), ("show", str(job)), ("top", "--once")):
        r = daemon.cli(*args)
        assert r.returncode == 0, (args, r)
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout, (args, r.stdout)
    assert "\\x1b]0;PWNED\\x07" in daemon.cli("show", str(job)).stdout
    r = daemon.cli("cancel", str(job))
    assert r.returncode == 0, r.stderr
    daemon.state(job, "CANCELLED")


def _job(name: str, user: str, uid: int) -> NewJob:
    return NewJob(name=name, user=user, uid=uid, gid=uid, argv=["echo", f"secret-{name}"], cwd="/", env={},
                  priority=1, gpus=1, mem_bytes=0)


def test_the_store_lists_by_uid(tmp_path):
    store = Store(tmp_path / "state.db")
    try:
        old, new = store.add_jobs([_job("old", "carol", 1009), _job("new", "carol", 1999)], 1.0)
        jobs, more = store.page(1999, 10)
        assert [j.id for j in jobs] == [new] and not more
        assert store.count(1999) == 1 and store.count() == 2
        assert store.recent_finished(1009, 5) == []
    finally:
        store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_new_account_under_an_old_name_does_not_list_the_old_accounts_jobs(make_daemon):
    daemon = make_daemon()
    first, second = AsUser(54321, 54321), AsUser(54322, 54322)
    code, rec = first.api(daemon.home, "POST", "/v1/jobs", {"argv": ["true"], "cwd": "/tmp", "name": "secretproj",
                                                            "env": {"PATH": os.environ["PATH"]}})
    assert code == 201, rec
    daemon.state(rec["id"], "COMPLETED")
    # The first account's row now carries the name the second one has (uid 54322 has no passwd
    # entry: its name is "54322"), as after `userdel carol; useradd carol` with another uid.
    db = sqlite3.connect(daemon.home / "state.db")
    with db:
        db.execute("UPDATE jobs SET user='54322' WHERE id=?", (rec["id"],))
    db.close()
    code, jobs = second.api(daemon.home, "GET", "/v1/jobs")
    assert code == 200 and jobs == [], jobs
    code, overview = second.api(daemon.home, "GET", "/v1/overview")
    assert code == 200 and all(j["id"] != rec["id"] for j in overview["jobs"]), overview
    code, mine = first.api(daemon.home, "GET", "/v1/jobs")
    assert code == 200 and [j["id"] for j in mine] == [rec["id"]], mine


def test_live_and_finished_jobs_are_read_at_one_instant(tmp_path):
    """The dashboard's overview lists live jobs, then the newest finished ones. A job that ended
    between two separate reads was drawn twice (RUNNING and COMPLETED rows, CI saw it); read at
    one instant, it is in exactly one list. The job is cancelled from another thread the moment the
    live list has been read: the store must make that write wait for the second read."""
    import threading

    from gpuswap.jobs import JobState
    from gpuswap.lifecycle import EventKind, NewEvent

    store = Store(tmp_path / "state.db")
    try:
        (job,) = store.add_jobs([_job("racing", "carol", 1009)], 1.0)
        real_list, writer = store.list, []

        def cancel() -> None:
            store.update(job, 2.0, NewEvent(EventKind.CANCELLED, "cancelled before it ran", initiator="user"),
                         state=JobState.CANCELLED, end_time=2.0)

        def list_then_end_it(*args, **kwargs):
            out = real_list(*args, **kwargs)
            if not writer:
                writer.append(threading.Thread(target=cancel))
                writer[0].start()
                writer[0].join(0.5)   # done by now unless the store holds it off
            return out

        store.list = list_then_end_it
        with store.at_one_instant():
            live = store.list(live_only=True)
            finished = store.recent_finished(1009, 5)
        writer[0].join()
        assert sorted([j.id for j in live] + [j.id for j in finished]) == [job], (live, finished)
        assert store.get(job).state == JobState.CANCELLED
    finally:
        store.close()


def test_the_runtime_predictor_learns_from_a_uids_runs_not_a_names(tmp_path):
    """An account made again under a deleted one's name (another uid) gets no estimate from the
    first one's runs, neither from its recorded jobs nor from what the retention sweep kept."""
    from gpuswap.jobs import JobState
    from gpuswap.lifecycle import EventKind, NewEvent

    store = Store(tmp_path / "state.db")
    try:
        first = store.add_jobs([_job("train", "carol", 1009), _job("train", "carol", 1009)], 1.0)
        for n, job in enumerate(first):
            store.update(job, 2.0 + n, NewEvent(EventKind.STARTED, "started"), state=JobState.RUNNING, assigned=[0])
            store.update(job, 100.0 + n, NewEvent(EventKind.COMPLETED, "exited with code 0"),
                         state=JobState.COMPLETED, assigned=[], end_time=100.0 + n, run_s=98.0)
        assert store.finished_runs(1009, "train", 5) == ([98.0, 98.0], [98.0, 98.0])
        assert store.finished_runs(1999, "train", 5) == ([], [])
        assert store.delete_finished(first[0])   # the sweep keeps what the predictor needs of it
        assert store.finished_runs(1009, "train", 5) == ([98.0, 98.0], [98.0, 98.0])
        assert store.finished_runs(1999, "train", 5) == ([], [])
    finally:
        store.close()
