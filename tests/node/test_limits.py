"""Issue 10: size limits on requests, paged job lists, finished jobs' bulky data out of the hot
table and forgotten after --retention, and a database from the previous version migrated."""
from __future__ import annotations

import json
import sqlite3
import time

import httpx

from gpuswap_testing import Gate

# The documented limits (docs/limits.md), stated here so the test checks the contract.
MAX_ARGV_BYTES = MAX_ENV_BYTES = 256 * 1024
MAX_ENV_VARS = 4096
MAX_STRING_BYTES = 128 * 1024

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


def raw(daemon) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.home / "gpuswap.sock")),
                        base_url="http://x", timeout=60)


def test_oversized_requests_are_refused_and_a_job_at_the_limit_runs(daemon):
    c = raw(daemon)
    base = {"cwd": str(daemon.home), "env": {"PATH": "/usr/bin:/bin"}}
    # argv over its byte limit, env over its byte and count limits: 422 naming the limit
    for body, words in (
        ({**base, "argv": ["true"] + ["x" * (MAX_STRING_BYTES - 1)] * 3}, "argv is"),
        ({**base, "argv": ["true", "x" * MAX_STRING_BYTES]}, "an argument is"),
        ({**base, "argv": ["true"], "env": {f"A{i}": "y" * 100_000 for i in range(3)}}, "env is"),
        ({**base, "argv": ["true"], "env": {"A": "y" * MAX_STRING_BYTES}}, "an env variable is"),
        ({**base, "argv": ["true"], "env": {f"V{i}": "" for i in range(MAX_ENV_VARS + 1)}}, "env has"),
    ):
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 422 and words in r.json()["detail"] and "limit" in r.json()["detail"], r.text
    # a body over 1 MiB: refused from its Content-Length, and (chunked) from its streamed bytes
    r = c.post("/v1/jobs", content=b"{" + b" " * (2 << 20) + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413 and "too large" in r.json()["detail"]

    def chunks():
        for _ in range(64):
            yield b" " * (64 << 10)
    r = c.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "too large" in r.json()["detail"]
    assert c.get("/v1/jobs", params={"limit": 1000}).json() == []   # nothing of it was stored
    # a job at the limits (argv and env just under them) is accepted and sees all of it
    out = daemon.home / "len.txt"
    script = f'echo ${{#1}} ${{#2}} ${{#BIG}} > {out}'
    arg = "a" * ((MAX_ARGV_BYTES - len(script) - 20) // 2)     # two arguments: argv at its limit
    env = {"PATH": "/usr/bin:/bin", "BIG": "e" * (MAX_STRING_BYTES - 10)}
    env.update({f"V{i}": "v" * 25 for i in range(MAX_ENV_VARS - len(env))})
    env_bytes = sum(len(k) + len(v) + 2 for k, v in env.items())
    assert MAX_ENV_BYTES - 4096 < env_bytes <= MAX_ENV_BYTES
    r = c.post("/v1/jobs", json={**base, "env": env, "argv": ["sh", "-c", script, "sh", arg, arg]})
    assert r.status_code == 201, r.text
    assert daemon.state(r.json()["id"], *TERMINAL)["state"] == "COMPLETED"
    assert out.read_text().split() == [str(len(arg))] * 2 + [str(MAX_STRING_BYTES - 10)]
    # the CLI says it in one line, exit 64
    cli = daemon.cli("submit", "--", "true", *["z" * 100_000] * 3)
    assert cli.returncode == 64 and "argv is" in cli.stderr and "Traceback" not in cli.stderr
    # a body over 1 MiB: the CLI says why (it once sent it, met a closed pipe and exited 69)
    cli = daemon.cli("submit", "--", "echo", *["a" * 120_000] * 10)
    assert cli.returncode == 64 and cli.stderr == "gpuswap: request body too large: the limit is 1 MiB\n", cli
    assert c.get("/v1/jobs", params={"limit": 1000}).json()[-1]["argv"][0] == "sh"     # no job was added


def test_job_lists_are_paged_newest_first_and_the_cli_follows(daemon):
    ids = [daemon.submit(["true"], name=f"j{i}") for i in range(23)]
    for i in ids:
        daemon.state(i, *TERMINAL)
    c = raw(daemon)
    r = c.get("/v1/jobs", params={"limit": 10})
    assert [j["id"] for j in r.json()] == ids[-10:]          # the newest 10, in id order
    assert r.headers["X-Total-Count"] == "23" and r.headers["X-Next-Before"] == str(ids[-10])
    seen, before = r.json(), r.headers["X-Next-Before"]
    while before:
        r = c.get("/v1/jobs", params={"limit": 10, "before": before})
        seen = r.json() + seen
        before = r.headers.get("X-Next-Before")
    assert [j["id"] for j in seen] == ids
    seen, after = [], "0"
    while after:
        r = c.get("/v1/jobs", params={"limit": 7, "after": after})
        seen += r.json()
        after = r.headers.get("X-Next-After")
    assert [j["id"] for j in seen] == ids
    assert c.get("/v1/jobs", params={"limit": 100000}).status_code == 422
    both = c.get("/v1/jobs", params={"before": ids[-1], "after": ids[0]})     # opposite walks: one at most
    assert both.status_code == 422 and "not both" in both.json()["detail"], both.text[:300]
    short = daemon.cli("ls", "--limit", "5")
    assert short.returncode == 0 and "the newest 5 of 23 jobs" in short.stderr
    assert [j["id"] for j in json.loads(daemon.cli("ls", "-n", "5", "--json").stdout)] == ids[-5:]
    every = json.loads(daemon.cli("ls", "--limit", "0", "--json").stdout)
    assert [j["id"] for j in every] == ids
    overview = c.get("/v1/overview").json()            # the dashboard: the 20 newest finished
    assert [j["id"] for j in overview["jobs"]] == ids[-20:]


def test_finished_jobs_are_forgotten_after_retention_and_live_ones_never(make_daemon):
    daemon = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--retention", "3s")
    live = daemon.submit(["sleep", "600"])
    daemon.state(live, "RUNNING")
    # It ends once the test has seen its files: ended, it is forgotten 3 s after its end, which can
    # come before a loaded machine's test has looked at it (a 404 instead of COMPLETED).
    gate = Gate(daemon.home / "done.go")
    done = daemon.submit(gate.hold(then="print('output')"))
    daemon.state(done, "RUNNING")
    daemon.until(done, lambda _: (daemon.home / "jobs" / str(done) / "output.log").exists())
    gate.open()
    deadline = time.monotonic() + 120
    while raw(daemon).get(f"/v1/jobs/{done}").status_code != 404:   # the sweep runs every second
        assert time.monotonic() < deadline, "the finished job was never forgotten"
        time.sleep(0.2)
    assert not (daemon.home / "jobs" / str(done)).exists()
    db = sqlite3.connect(daemon.home / "state.db")
    for table in ("events", "job_specs", "decisions"):
        assert db.execute(f"SELECT COUNT(*) FROM {table} WHERE job_id=?", (done,)).fetchone()[0] == 0
    assert daemon.job(live)["state"] == "RUNNING" and (daemon.home / "jobs" / str(live)).exists()
    nxt = daemon.submit(["true"])                   # ids are never reused after a delete
    assert nxt > done
    assert daemon.cli("cancel", str(live)).returncode == 0


OLD_SCHEMA = """
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, user TEXT NOT NULL, uid INTEGER NOT NULL,
    gid INTEGER NOT NULL, argv TEXT NOT NULL, cwd TEXT NOT NULL, env TEXT NOT NULL, priority INTEGER NOT NULL,
    gpus INTEGER NOT NULL, mem_bytes INTEGER NOT NULL, preemptible INTEGER NOT NULL, state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '', exit_code INTEGER, signal INTEGER, submit_time REAL NOT NULL,
    state_since REAL NOT NULL, last_start REAL, end_time REAL, attained_gpu_s REAL NOT NULL DEFAULT 0,
    run_s REAL NOT NULL DEFAULT 0, switch_s REAL NOT NULL DEFAULT 0, assigned TEXT NOT NULL DEFAULT '[]',
    home_gpus TEXT NOT NULL DEFAULT '[]', parked TEXT, parked_bytes INTEGER NOT NULL DEFAULT 0,
    device_bytes INTEGER NOT NULL DEFAULT 0, generation INTEGER NOT NULL DEFAULT 0,
    desired TEXT NOT NULL DEFAULT 'running', desired_tier TEXT, pause_requested_at REAL,
    hold INTEGER NOT NULL DEFAULT 0, no_runtime INTEGER NOT NULL DEFAULT 0, stopped INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0, preemptions INTEGER NOT NULL DEFAULT 0, step INTEGER,
    pause_mode TEXT NOT NULL DEFAULT 'auto', mechanism TEXT, attached INTEGER NOT NULL DEFAULT 0,
    transparent_refused TEXT, abort_reason TEXT, ram_allowance INTEGER, version INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id INTEGER NOT NULL, time REAL NOT NULL,
                     state TEXT NOT NULL, reason TEXT NOT NULL);
"""


def test_a_database_from_the_previous_version_is_migrated_without_losing_jobs(home, make_daemon):
    out = home / "pending-ran.txt"
    db = sqlite3.connect(home / "state.db")
    db.executescript(OLD_SCHEMA)
    now = time.time()
    rows = [  # (id, argv, env, state, end_time)
        (1, ["echo", "old"], {"SECRET": "finished-job-secret"}, "COMPLETED", now - 60),
        (2, ["sh", "-c", f'echo "$MARK" > {out}'], {"MARK": "from-the-old-db", "PATH": "/usr/bin:/bin"},
         "PENDING", None),
    ]
    for jid, argv, env, state, end in rows:
        db.execute("INSERT INTO jobs (id,name,user,uid,gid,argv,cwd,env,priority,gpus,mem_bytes,preemptible,"
                   "state,reason,submit_time,state_since,end_time,version) "
                   "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (jid, f"old{jid}", "root", 0, 0, json.dumps(argv), str(home), json.dumps(env), 0, 1, 0, 1,
                    state, "old", now - 100, now - 60, end, jid))
        db.execute("INSERT INTO events (job_id,time,state,reason) VALUES (?,?,?,?)", (jid, now - 100, state, "old"))
    db.commit()
    db.close()
    daemon = make_daemon()
    finished = daemon.job(1)
    assert finished["state"] == "COMPLETED" and finished["argv"] == ["echo", "old"] and finished["events"]
    assert daemon.state(2, *TERMINAL)["state"] == "COMPLETED"      # launched with its stored env
    assert out.read_text().strip() == "from-the-old-db"
    db = sqlite3.connect(home / "state.db")
    columns = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
    assert "env" not in columns and "argv" not in columns
    assert db.execute("SELECT env FROM job_specs WHERE job_id=1").fetchone()[0] is None   # ended: dropped
    assert db.execute("SELECT env FROM job_specs WHERE job_id=2").fetchone()[0] is None
    assert daemon.submit(["true"]) == 3
