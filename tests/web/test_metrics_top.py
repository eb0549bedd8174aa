"""`/metrics` and `gpuswap top` against a real daemon in which an urgent job preempts a long one."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuswap.jobs import JobState
from webtools import Web, start_web, web  # noqa: F401  (fixture)

from gpuswap_testing import FACT_TIMEOUT_S, Gate, forever


def train_cmd(out, steps: int, step_time: float) -> list[str]:
    return [sys.executable, "-m", "gpuswap.demo.train", "--steps", str(steps), "--step-time", str(step_time),
            "--out", str(out)]


def scrape(web: Web, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with web.http(token) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


@pytest.fixture
def preempted(make_daemon, home):
    """One GPU: a long low-priority job is parked in RAM for an urgent one, which holds the GPU
    until the test opens the returned gate (then it finishes and the long job resumes)."""
    web = start_web(make_daemon, "1x80GiB")
    d = web.daemon
    # Held at its last steps until cancelled: it must not complete while a test restarts the daemon
    # and counts the finished jobs (a restart alone took 30 s at load 17).
    long_id = d.submit(Gate(home / "never").train(home / "long.json", 3000, 0.02), name="long", priority="low",
                       mem="20GiB", time_limit_s=7200)
    d.until(long_id, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 5)
    gate = Gate(home / "urgent.go")
    urgent = d.submit(gate.hold(), name="urgent", priority="urgent")
    d.state(long_id, "PAUSED")
    yield web, long_id, urgent, gate
    gate.open()


def test_metrics_reflect_preemption_and_survive_restart(preempted):
    web, long_id, urgent, gate = preempted
    token = web.token()
    with web.http(None) as anon:
        assert anon.get("/metrics").status_code == 401
    m = scrape(web, token)
    assert m[("gpuswap_jobs", (("priority", "low"), ("state", "PAUSED")))] == 1
    # Per GPU, a bounded set of series: which state it is in (job ids belong to the logs, not labels).
    assert {k: v for k, v in m.items() if k[0] == "gpuswap_gpu_state"} == {
        ("gpuswap_gpu_state", (("gpu", "0"), ("simulated", "true"), ("state", s))): float(s == "running")
        for s in ("free", "running", "resuming", "pausing", "stopped")}
    assert m[("gpuswap_gpu_jobs", (("gpu", "0"), ("simulated", "true")))] == 1
    # Every per-GPU series says its GPU is simulated: none can pass one for a real GPU.
    per_gpu = [k for k in m if k[0].startswith("gpuswap_gpu_")]
    assert {k[0] for k in per_gpu} == {"gpuswap_gpu_memory_total_bytes", "gpuswap_gpu_memory_used_bytes",
                                       "gpuswap_gpu_state", "gpuswap_gpu_jobs"}
    assert all(("simulated", "true") in k[1] for k in per_gpu), per_gpu
    with web.http(token) as c:        # and its help says where a simulated GPU's figure comes from
        helps = {f.name: f.documentation for f in text_string_to_metric_families(c.get("/metrics").text)}
    assert "the simulated device's process list" in helps["gpuswap_gpu_memory_used_bytes"], helps
    assert not [k for k in m if any(label == "job_id" for label, _ in k[1])]
    assert not [k for k in m if k[0].startswith("gpuswap_node_")]     # one machine: no pool's node series
    assert m[("gpuswap_gpu_memory_total_bytes", (("gpu", "0"), ("simulated", "true")))] == 80 * 2**30
    key = ("gpuswap_preemptions_total", (("mechanism", "cooperative"), ("tier", "ram")))
    assert m[key] == 1
    assert not [k for k in m if k[0] == "gpuswap_user_pauses_total"]
    assert m[("gpuswap_park_duration_seconds_count", (("tier", "ram"),))] == 1
    assert m[("gpuswap_parked_bytes", (("tier", "ram"),))] > 0
    assert m[("gpuswap_ram_budget_bytes", ())] > 0
    assert m[("gpuswap_queue_wait_seconds_count", ())] == 2
    d = web.daemon
    gate.open()
    d.state(urgent, "COMPLETED", timeout=60)
    d.state(long_id, "RUNNING", timeout=60)
    m = scrape(web, token)
    assert m[("gpuswap_resume_duration_seconds_count", (("tier", "ram"),))] == 1
    assert m[("gpuswap_jobs_finished_total", (("state", "COMPLETED"),))] == 1
    assert m[("gpuswap_fair_share_usage_gpu_seconds", (("user", "root"),))] > 0
    d.stop()
    d.start()     # counters are folded from the durable event log: a restart keeps them
    m = scrape(web, token)
    assert m[key] == 1 and m[("gpuswap_jobs_finished_total", (("state", "COMPLETED"),))] == 1
    d.cli("cancel", str(long_id))


def test_metrics_count_a_spill_to_disk_and_the_disk_restart(make_daemon, home):
    """RAM park, then spill to disk, then resume: one RAM preemption, one spill, a disk park and
    a disk resume; nothing of the restart is counted under the RAM tier."""
    web = start_web(make_daemon, "1x80GiB")
    d, token = web.daemon, web.token()
    job = d.submit(train_cmd(home / "s.json", 3000, 0.02), name="s")
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    assert d.cli("pause", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    assert d.cli("pause", "--to", "disk", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    m = scrape(web, token)
    # The owner's pause is no preemption: counted apart, and preemptions_total stays empty.
    ram_key = ("gpuswap_user_pauses_total", (("mechanism", "cooperative"), ("tier", "ram")))
    assert m[ram_key] == 1
    assert not [k for k in m if k[0] == "gpuswap_preemptions_total"]
    assert not [k for k in m if k[0] == "gpuswap_user_pauses_total" and ("tier", "disk") in k[1]]
    assert m[("gpuswap_spills_total", (("initiator", "user"),))] == 1
    assert m[("gpuswap_spills_total", (("initiator", "policy"),))] == 0
    assert m[("gpuswap_park_duration_seconds_count", (("tier", "ram"),))] == 1
    assert m[("gpuswap_park_duration_seconds_count", (("tier", "disk"),))] == 1
    assert m[("gpuswap_parked_bytes", (("tier", "disk"),))] > 0
    assert d.cli("resume", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    m = scrape(web, token)
    assert m[("gpuswap_resume_duration_seconds_count", (("tier", "disk"),))] == 1
    assert m[("gpuswap_resume_duration_seconds_count", (("tier", "ram"),))] == 0
    d.stop()
    d.start()     # the refold from the event log agrees
    m2 = scrape(web, token)
    for key in (("gpuswap_spills_total", (("initiator", "user"),)),
                ("gpuswap_park_duration_seconds_count", (("tier", "disk"),)),
                ("gpuswap_resume_duration_seconds_count", (("tier", "disk"),)), ram_key):
        assert m2[key] == m[key], key
    d.cli("cancel", str(job))


def test_overview_and_top_once_show_the_parked_job(preempted):
    web, long_id, urgent, _ = preempted
    held = f"GPU 0 held by job {urgent} (urgent, not preemptible by a lower priority)"
    # The round that preempts says "given to job N this round"; the next ones say it holds GPU 0.
    web.daemon.until(long_id, lambda j: held in (j.get("pending_reason_text") or ""))
    with web.http(web.token()) as c:
        o = c.get("/v1/overview").json()
    j = next(j for j in o["jobs"] if j["id"] == long_id)
    assert j["state"] == "PAUSED" and j["tier"] == "ram" and j["parked_bytes"] > 0
    assert j["pending_reason"] == "Priority", j     # the policy's own reason: the urgent job holds its GPU
    assert held in j["pending_reason_text"]
    assert o["gpus"][0]["jobs"] == [urgent] and o["ram"]["parked"] == j["parked_bytes"]
    assert o["fair_share"][0]["user"] == "root"
    # Its --time estimate and what is left of it (the dashboard's Left): 2 h less its run time.
    run_s = web.daemon.job(long_id)["run_s"]        # a parked job's run time stands still
    assert j["estimate_s"] == 7200 and j["estimate_left_s"] == pytest.approx(7200 - run_s, abs=1)
    out = web.daemon.cli("top", "--once")
    assert out.returncode == 0, out.stderr
    for text in ("SIMULATED GPUs", "long", "urgent", "PAUSED", "RAM", "host RAM parked", "fair share", "root"):
        assert text in out.stdout, (text, out.stdout)
    web.daemon.cli("cancel", str(long_id))


def test_top_once_shows_markup_in_names_verbatim(daemon):
    """Job names are the users' words: rich markup in them is shown as text, never parsed
    ("[/x]" used to crash `top` with a MarkupError; "[bold]x" was rendered as bold "x")."""
    names = ["[/x]", "[bold]x", "[red]r[/red]", "[link=http://e.x]y"]
    ids = [daemon.submit(forever(daemon.home), name=n) for n in names]
    out = daemon.cli("top", "--once")
    assert out.returncode == 0, out.stderr
    assert "MarkupError" not in out.stderr
    for n in names:
        assert n in out.stdout, (n, out.stdout)
    for i in ids:
        daemon.cli("cancel", str(i))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (tests/setup-system.sh installs it)")
def test_top_live_in_tmux_refreshes_and_quits_on_q(web):
    job = web.daemon.submit(forever(web.daemon.home), name="tmux-visible")
    session = f"gstop{os.getpid()}"
    cmd = f"GPUSWAP_HOME={web.daemon.home} {sys.executable} -m gpuswap.cli.main top"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40", cmd], check=True)
    try:
        first = _pane_shows(session, lambda t: "tmux-visible" in t and "RUNNING" in t and "q quits" in t)
        _pane_shows(session, lambda t: t != first)     # the clock and times in state moved
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 180
        while subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "gpuswap top did not quit on q"
            time.sleep(0.1)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        web.daemon.cli("cancel", str(job))



def _pane_shows(session: str, want, timeout: float = FACT_TIMEOUT_S) -> str:
    """The tmux pane's text once `want(text)` holds (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
        if want(seen):
            return seen
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (tests/setup-system.sh installs it)")
def test_top_live_survives_a_daemon_restart(daemon):
    """The live view says the daemon is gone and keeps retrying, then shows the jobs again;
    without a daemon from the start it exits 69, as `--once` does."""
    job = daemon.submit(forever(daemon.home), name="outlives-restart")
    session = f"gstopr{os.getpid()}"
    rc_file = daemon.home / "top.rc"
    cmd = (f"GPUSWAP_HOME={daemon.home} {sys.executable} -m gpuswap.cli.main top --interval 0.2; "
           f"echo $? > {rc_file}; sleep 30")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40", cmd], check=True)
    try:
        _pane_shows(session, lambda t: "outlives-restart" in t and "RUNNING" in t)
        daemon.stop()
        # The last picture stays under the banner. Polled, not asserted on the first capture that
        # shows the banner: a capture can land while the terminal is still being redrawn.
        _pane_shows(session, lambda t: "daemon unavailable — retrying" in t and "outlives-restart" in t)
        daemon.start()
        # The jobs drawn again without the banner: only a view still running, still retrying,
        # fetches them (one that had quit would have left a blank screen), so it never quit.
        _pane_shows(session, lambda t: "outlives-restart" in t and "unavailable" not in t)
        assert not rc_file.exists()
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 180
        while not (rc_file.exists() and rc_file.read_text().strip()):
            assert time.monotonic() < deadline, "gpuswap top did not quit on q"
            time.sleep(0.1)
        assert rc_file.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    daemon.cli("cancel", str(job))
    daemon.stop()
    assert daemon.cli("top", "--once").returncode == 69
    rc_file.unlink()
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40", cmd], check=True)
    try:
        deadline = time.monotonic() + 180
        while not (rc_file.exists() and rc_file.read_text().strip()):
            assert time.monotonic() < deadline, "gpuswap top did not exit without a daemon"
            time.sleep(0.1)
        assert rc_file.read_text().strip() == "69"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def _file_becomes(path, content: str, timeout: float = FACT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text() == content):
        assert time.monotonic() < deadline, (path, path.read_text() if path.exists() else "missing")
        time.sleep(0.2)


def test_dcgm_job_mapping_files_follow_the_jobs(make_daemon, tmp_path):
    mapdir = tmp_path / "dcgm"
    web = start_web(make_daemon, "2x80GiB", "--dcgm-job-mapping-dir", str(mapdir))
    job = web.daemon.submit(forever(web.daemon.home), name="mapped")
    gpu = web.daemon.state(job, "RUNNING")["assigned_gpus"][0]
    _file_becomes(mapdir / str(gpu), f"{job}\n")
    _file_becomes(mapdir / str(1 - gpu), "")
    web.daemon.cli("cancel", str(job))
    _file_becomes(mapdir / str(gpu), "")


def test_a_dcgm_mapping_that_cannot_be_written_is_logged_once_until_it_can(make_daemon, tmp_path):
    """It used to log a traceback on every pass (every 2 s) for as long as the failure lasted.
    GPU 1's file made a directory fails every pass after GPU 0's file is written: a change of GPU
    0's file is a pass, so the test knows two failing passes came after the first was logged."""
    mapdir = tmp_path / "dcgm"
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--dcgm-job-mapping-dir", str(mapdir))
    _file_becomes(mapdir / "1", "")
    (mapdir / "1").unlink()
    (mapdir / "1").mkdir()
    log = d.home / "daemon.out"
    failed = f"cannot write the dcgm-exporter job mapping to {mapdir}: Is a directory"
    _log_says(log, failed)
    job = d.submit(forever(d.home), name="mapped", gpus=2)
    _file_becomes(mapdir / "0", f"{job}\n")              # a pass after the first failure
    d.cli("cancel", str(job))
    _file_becomes(mapdir / "0", "")                       # and another
    (mapdir / "1").rmdir()
    _file_becomes(mapdir / "1", "")
    _log_says(log, f"writing the dcgm-exporter job mapping to {mapdir} works again")
    text = log.read_text()
    assert text.count("dcgm-exporter") == 2 and "Traceback" not in text, text


def _log_says(path, line: str, timeout: float = FACT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while line not in path.read_text():
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.2)


def test_a_home_from_before_the_initiator_column_is_migrated_and_folded(tmp_path):
    """An events table without `initiator` (a home made by an older daemon) gains the column on
    open; its old rows are folded by their wording (a user pause is not a preemption), new rows
    by the recorded initiator."""
    import sqlite3

    from gpuswap.api.metrics import EventFold
    from gpuswap.lifecycle import EventKind, NewEvent
    from gpuswap.node.store import NewJob, Store

    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id INTEGER NOT NULL, "
               "time REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL)")
    db.executemany("INSERT INTO events (job_id,time,state,reason) VALUES (?,?,?,?)", [
        (99, 0, "PENDING", "submitted"), (99, 1, "RUNNING", "started on GPU 0"),
        (99, 2, "PAUSING", "pausing to ram: requested by user"), (99, 3, "PAUSED", "parked in RAM at step 5")])
    db.commit()
    db.close()
    store = Store(tmp_path / "state.db")
    [job] = store.add_jobs([NewJob(name="j", user="u", uid=0, gid=0, argv=["x"], cwd="/", env={}, priority=1,
                                   gpus=1, mem_bytes=0)], 4)
    store.update(job, 5, state=JobState.RUNNING, assigned=[1], event=NewEvent(EventKind.STARTED, "started on GPU 1"))
    # The wording says "requested by user", the record says policy: the record is what counts.
    store.update(job, 6, state=JobState.PAUSING, mechanism="cooperative", desired="paused", desired_tier="ram",
                 pause_requested_at=6, event=NewEvent(EventKind.PARK_STARTED, "pausing to ram: requested by user",
                                                      tier="ram", mechanism="cooperative"), initiator="policy")
    store.update(job, 7, state=JobState.PAUSED, parked="ram", home_gpus=[1], assigned=[],
                 event=NewEvent(EventKind.PARKED_RAM, "parked in RAM at step 9"))
    fold = EventFold()
    fold.advance(store)
    assert fold.user_pauses == {("cooperative", "ram"): 1}
    assert fold.preemptions == {("cooperative", "ram"): 1}


def test_a_pools_gpu_count_per_node_says_whether_its_gpus_are_simulated():
    """Simulated GPUs announce themselves in every output that shows GPUs: a count of them too.
    `gpuswap_node_gpus` was labelled by node only, so a panel of GPUs per node showed simulated
    ones as real (every per-GPU series already carried `simulated`)."""
    from types import SimpleNamespace

    from gpuswap.api.metrics import GpuswapCollector
    from gpuswap.node.gpus import GpuInfo

    class Pool:
        simulated = True

        def list(self):
            return [GpuInfo(0, "simulated GPU", "GPU-a", 2**30, 0, True, node="n1")]

    controller = SimpleNamespace(pool=SimpleNamespace(ram_budget=lambda node, default: 1),
                                 config=SimpleNamespace(ram_budget=1))
    live = [SimpleNamespace(node="n2", state=JobState.RUNNING, parked=None, parked_bytes=0)]   # n2 does not answer
    fams = {f.name: f for f in GpuswapCollector(None, controller, Pool())._nodes(live, Pool().list())}
    got = {(s.labels["node"], s.labels.get("simulated")): s.value for s in fams["gpuswap_node_gpus"].samples}
    assert got == {("n1", "true"): 1, ("n2", "true"): 0}


def test_the_fold_stops_at_the_instant_the_live_jobs_were_read(tmp_path):
    """A scrape reads the live jobs and the last event id at one instant, then folds the events up
    to that id: a job that ends after the live read is live in this scrape and finished in the next,
    never in neither. (Folding all of them under the store's lock held every write for as long.)"""
    from gpuswap.api.metrics import EventFold
    from gpuswap.lifecycle import EventKind, NewEvent
    from gpuswap.node.store import NewJob, Store

    store = Store(tmp_path / "state.db")
    try:
        [job] = store.add_jobs([NewJob(name="j", user="u", uid=0, gid=0, argv=["x"], cwd="/", env={}, priority=1,
                                       gpus=1, mem_bytes=0)], 1)
        store.update(job, 2, state=JobState.RUNNING, assigned=[0], event=NewEvent(EventKind.STARTED, "started"))
        with store.at_one_instant():
            live = store.list(live_only=True)
            upto = store.last_event_id()
        store.update(job, 3, state=JobState.COMPLETED, assigned=[], end_time=3, exit_code=0,
                     event=NewEvent(EventKind.COMPLETED, "exited with code 0"))
        fold = EventFold()
        fold.advance(store, upto)
        assert [j.id for j in live] == [job] and fold.last_id == upto == 2 and fold.finished == {}
        fold.advance(store)
        assert fold.last_id == 3 and fold.finished == {"COMPLETED": 1}
    finally:
        store.close()
