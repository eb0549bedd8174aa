"""A pool of two Ray nodes on this machine (docs/ray.md), against a real Ray cluster: each node's
agent with its own simulated GPU and state directory, a real head daemon (`gpuswap server --ray`),
real jobs. One cluster and one head for the module: Ray's start-up is the slow part."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "gpuswap[ray]")')

from ray.cluster_utils import Cluster  # noqa: E402

from gpuswap.api.client import ClientError  # noqa: E402
from gpuswap.node.launcher import Launcher  # noqa: E402
from gpuswap.node.raypool import NAMESPACE  # noqa: E402
from gpuswap.protocol import env as envvars  # noqa: E402
from gpuswap_testing import FACT_TIMEOUT_S, AsUser, Daemon, Gate, ensure_user  # noqa: E402
from webtools import CHROMIUM, CHROMIUM_ARGS, free_port, why_no_browser  # noqa: E402

NODES = ("node-a", "node-b")


def node_args(base: Path, name: str, gpus: str = "1x80GiB") -> dict[str, Any]:
    """One Ray node: its own resource (so it can be told apart on one machine), and in its
    environment its agent's state directory, its simulated GPUs (one unless `gpus` says), its name
    in the pool and the checkpoint directory every node shares (on one machine, one directory)."""
    return dict(num_cpus=1, object_store_memory=80 * 1024**2, include_dashboard=False,
                resources={name.replace("-", "_"): 1},
                env_vars={envvars.AGENT_HOME: str(base / f"agent-{name}"), envvars.AGENT_SIMULATE_GPUS: gpus,
                          envvars.NODE_NAME: name, envvars.AGENT_SHARED_CKPT: str(base / "shared-ckpt")})


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gs-ray-", dir="/tmp"))    # short: the socket's path is bounded
    d.chmod(0o755)          # other users' jobs pass through to their files
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(base: Path) -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args=node_args(base, NODES[0]))
    try:
        c.add_node(**node_args(base, NODES[1]))
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def head(base: Path, cluster: Cluster) -> Iterator[Daemon]:
    home = base / "head"
    home.mkdir()
    home.chmod(0o755)
    # --pause-timeout 600: a job asked to pause stays PAUSING until it reaches a safepoint, however
    # slow the machine (a node is removed mid-park below).
    # --listen: the dashboard's browser test reaches the head over TCP, as a lab's browsers would.
    d = Daemon(home, ["--ray", cluster.address, "--no-calibrate", "--min-runtime", "1", "--listen",
                      f"127.0.0.1:{free_port()}",
                      "--max-switch-fraction", "1", "--node-lost-after", "0", "--pause-timeout", "600"])
    try:
        d.start()
        # Every node's agent has joined: the pool lists both GPUs.
        d.until(0, lambda g: sorted(x["node"] for x in g["gpus"]) == list(NODES), get="/v1/gpus")
        yield d
    finally:
        d.stop()


def scrape(d: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The head's /metrics, sample by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families
    r = d.client.request("GET", "/metrics")
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def output(base: Path, job: dict[str, Any]) -> str:
    """A job's output, in its node's agent's state directory (on this machine, readable here)."""
    return (base / f"agent-{job['node']}" / "jobs" / str(job["id"]) / "output.log").read_text()


def test_a_job_lands_on_the_free_node_as_its_submitter_and_wait_gets_its_exit_code(head, base):
    gate = Gate(head.home / "busy.go")
    busy = head.submit(gate.hold(), name="busy", preemptible=False)
    first = head.state(busy, "RUNNING")
    uid, gid = ensure_user("gs-ray-user")
    user = AsUser(uid, gid)
    code, out, err = user.cli(head.home, "submit", "--name", "other", "--", "sh", "-c", "id -u; exit 7")
    assert code == 0, err
    job = int(out.split()[2])        # "submitted job ID (NAME)"
    code, _, err = user.cli(head.home, "wait", str(job))
    assert code == 7, err           # the job's own exit code, through `gpuswap wait`
    other = head.job(job)
    assert other["state"] == "FAILED" and other["exit_code"] == 7
    assert {first["node"], other["node"]} == set(NODES)      # the other node: the first one's GPU was busy
    assert output(base, other).split() == [str(uid)]           # it ran as its submitter
    gate.open()
    head.state(busy, "COMPLETED")


def test_a_user_on_a_node_uses_its_socket_and_acts_on_their_own_jobs_only(head, base):
    """`gpuswap` on a node of the pool: its agent's socket (node/gateway.py) carries each request
    with the caller its kernel reported, and the head answers it as that caller (api/forwarded.py)."""
    gate = Gate(head.home / "fwd-busy.go")
    busy = head.submit(gate.hold(), name="busy-here", preemptible=False)
    here = head.state(busy, "RUNNING")["node"]       # this node's GPU is taken: the job must go elsewhere
    there = next(n for n in NODES if n != here)
    node_socket = base / f"agent-{here}"             # what the CLI finds on that server
    alice, bob = (AsUser(*ensure_user(n)) for n in ("gs-ray-user", "gs-ray-user2"))
    code, out, err = alice.cli(node_socket, "submit", "--name", "fwd", "--", "sh", "-c", "id -u; exit 5")
    assert code == 0, err
    job = int(out.split()[2])
    code, _, err = alice.cli(node_socket, "wait", str(job))
    assert code == 5, err                            # the job's own exit code, through the node's socket
    done = head.job(job)
    assert done["node"] == there and done["user"] == "gs-ray-user" and done["exit_code"] == 5
    assert output(base, done).split() == [str(alice.uid)]      # it ran as its submitter, on the other node
    code, out, err = alice.cli(node_socket, "logs", str(job))  # read there by that node's agent
    assert code == 0 and out.split() == [str(alice.uid)], (code, out, err)
    status, record = alice.api(node_socket, "GET", f"/v1/jobs/{job}")
    assert status == 200 and record["node"] == there, record
    assert record["log"] == str(base / f"agent-{there}" / "jobs" / str(job) / "output.log")   # on its node
    # Another user on that node sees and touches none of it; root there is an admin, as on the head.
    code, out, _ = bob.cli(node_socket, "ls")
    assert code == 0 and "fwd" not in out and "busy-here" not in out, out
    assert bob.api(node_socket, "GET", f"/v1/jobs/{job}") == (404, {"detail": f"no job {job}"})
    code, _, err = bob.cli(node_socket, "cancel", str(busy))
    assert code == 1 and f"no job {busy}" in err, err
    code, _, err = bob.cli(node_socket, "ls", "--all")
    assert code == 1 and "only admins" in err, err
    code, out, err = AsUser(0, 0).cli(node_socket, "ls", "--all")
    assert code == 0 and "fwd" in out and "busy-here" in out, (out, err)
    assert head.job(busy)["state"] == "RUNNING"
    gate.open()
    head.state(busy, "COMPLETED")


def test_urgent_job_preempts_the_parkable_job_on_its_node_which_resumes_there_exactly(head, base, reference_hashes):
    steps = 150
    held, long_gate, urgent_gate = (Gate(head.home / f"{n}.go") for n in ("held", "long", "urgent"))
    # One node's GPU is held by a job that may not be paused; the other's by a parkable low job.
    keep = head.submit(held.hold(), name="keep", priority="low", preemptible=False)
    kept = head.state(keep, "RUNNING")
    low = head.submit(long_gate.train(head.home / "long.json", steps), name="long", priority="low", mem="20GiB")
    running = head.until(low, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 20)
    assert running["node"] != kept["node"]
    urgent = head.submit(urgent_gate.hold("print('eval ok')"), name="urgent", priority="urgent")
    parked = head.until(low, lambda j: j["state"] == "PAUSED")
    assert parked["parked"] == "ram" and parked["parked_bytes"] > 0 and parked["node"] == running["node"]
    taken = head.state(urgent, "RUNNING")
    assert taken["node"] == running["node"]           # where a job could be paused for it
    assert head.job(keep)["state"] == "RUNNING"

    # Every view names the node of each job and GPU (the urgent job holds the GPU until its gate opens).
    node = running["node"]
    gpus = head.cli("gpus").stdout
    rows = {line.split()[0]: line for line in gpus.splitlines() if line.split() and line.split()[0] in NODES}
    assert set(rows) == set(NODES), gpus
    assert f"{urgent} urgent RUNNING" in rows[node] and f"{keep} keep RUNNING" in rows[kept["node"]], gpus
    # Each node parks in its own RAM, against its own budget (half its memory: no --ram-budget).
    half = psutil.virtual_memory().total // 2
    ram = {r["node"]: r for r in head.client.get("/v1/gpus")["ram_nodes"]}
    assert ram == {node: {"node": node, "budget": half, "parked": parked["parked_bytes"]},
                   kept["node"]: {"node": kept["node"], "budget": half, "parked": 0}}, ram
    assert f"host RAM parked on {node}: " in gpus and f"host RAM parked on {kept['node']}: 0 B of a" in gpus, gpus
    ls = head.cli("ls").stdout
    assert f"[sim {node}:0]" in ls and f"[sim {kept['node']}:0]" in ls, ls
    assert f"on node {node}" in head.cli("show", str(low)).stdout
    assert f"on node {node}" in head.cli("show", str(urgent)).stdout
    # The dashboard's record and the metrics name them too.
    o = head.client.get("/v1/overview")
    assert sorted((g["node"], g["index"]) for g in o["gpus"]) == [(n, 0) for n in NODES]
    assert next(g for g in o["gpus"] if g["node"] == node)["jobs"] == [urgent]
    rows = {j["id"]: j for j in o["jobs"]}
    assert (rows[urgent]["node"], rows[low]["node"], rows[keep]["node"]) == (node, node, kept["node"])
    top = head.cli("top", "--once").stdout
    assert f"{node}:0 (sim)" in top and f"{kept['node']}:0 (sim)" in top, top
    m = scrape(head)
    assert m[("gpuswap_gpu_state", (("gpu", f"{node}:0"), ("simulated", "true"), ("state", "running")))] == 1
    assert {n: m[("gpuswap_node_ram_budget_bytes", (("node", n),))] for n in NODES} == {n: half for n in NODES}
    assert {n: m[("gpuswap_node_gpus", (("node", n), ("simulated", "true")))] for n in NODES} == {n: 1 for n in NODES}
    assert m[("gpuswap_node_jobs", (("node", node), ("state", "PAUSED")))] == 1
    assert m[("gpuswap_node_jobs", (("node", node), ("state", "RUNNING")))] == 1
    assert m[("gpuswap_node_jobs", (("node", kept["node"]), ("state", "RUNNING")))] == 1

    long_gate.open()
    urgent_gate.open()
    assert head.cli("wait", str(urgent)).returncode == 0
    done = head.state(low, "COMPLETED")
    states = [e["state"] for e in done["events"] if not e["reason"].startswith("waiting (")]
    assert states == ["PENDING", "RUNNING", "PAUSING", "PAUSED", "RESUMING", "RUNNING", "COMPLETED"]
    assert done["node"] == node and done["preemptions"] == 1
    # Its events name its GPU as `gpuswap gpus` does (the node's own index), not by the pool's id.
    resumed = next(e for e in done["events"] if e["kind"] == "resume_started")
    assert f"GPU {node}:0" in resumed["reason"], resumed
    started = next(e for e in head.job(urgent)["events"] if e["kind"] == "started")
    assert f"GPU {node}:0" in started["reason"], started
    assert json.loads((head.home / "long.json").read_text())["sha256"] == reference_hashes(steps)
    held.open()
    head.state(keep, "COMPLETED")


def test_a_job_parked_to_disk_resumes_on_the_other_node_from_shared_storage_exactly(head, base, reference_hashes):
    steps = 120
    gate, here_gate, there_gate = (Gate(head.home / f"{n}.go") for n in ("moved", "moved-here", "moved-there"))
    job = head.submit(gate.train(head.home / "moved.json", steps), name="moved", priority="low")
    running = head.until(job, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 10)
    here = running["node"]
    there_holder = head.submit(there_gate.hold(), name="there-holder", preemptible=False)
    there = head.state(there_holder, "RUNNING")["node"]          # the other node's GPU
    assert there != here
    r = head.cli("pause", "--to", "disk", str(job))
    assert r.returncode == 0, r.stderr
    parked = head.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    assert parked["node"] == here
    # Its own node's GPU is taken by a job that may not be paused; the other node's comes free.
    here_holder = head.submit(here_gate.hold(), name="here-holder", preemptible=False)
    assert head.state(here_holder, "RUNNING")["node"] == here
    there_gate.open()
    head.state(there_holder, "COMPLETED")
    r = head.cli("resume", str(job))
    assert r.returncode == 0, r.stderr
    gate.open()
    assert head.cli("wait", str(job)).returncode == 0
    done = head.job(job)
    assert done["node"] == there and done["state"] == "COMPLETED"
    resumed = next(e for e in done["events"] if e["kind"] == "resume_started")
    assert f"on GPU {there}:0" in resumed["reason"] and f"moved from {here}" in resumed["reason"], resumed
    assert json.loads((head.home / "moved.json").read_text())["sha256"] == reference_hashes(steps)
    here_gate.open()
    head.state(here_holder, "COMPLETED")


FAKE_CUDA = """import os, sys, time
from gpuswap import simcuda
simcuda.allocate(int(sys.argv[1]))
open(sys.argv[3], "w").close()
for i in range(1, 41):
    while i == 40 and not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    simcuda.sync()
    print(f"line{i}", flush=True)
    time.sleep(0.01)
"""


def test_an_unmodified_job_is_frozen_through_its_nodes_driver_and_thawed_there(head, base):
    """Transparent parking in a pool: the job has no gpuswap runtime; its node's agent freezes its
    CUDA process through that node's (simulated) checkpoint driver, and thaws it there."""
    from gpuswap.simcuda import DEFAULT_CONTEXT_BYTES as CTX
    GiB = 2**30
    caps = head.client.get("/v1/gpus")["transparent"]
    assert caps["available"] and all(f"{n}: SIMULATED checkpoint driver" in caps["description"] for n in NODES), caps
    held, gate, urgent_gate = (Gate(head.home / f"{n}.go") for n in ("frozen-held", "frozen", "frozen-urgent"))
    keep = head.submit(held.hold(), name="keep", preemptible=False)
    kept = head.state(keep, "RUNNING")["node"]
    script, ready = head.home / "fake_cuda.py", head.home / "fake-cuda.ready"
    script.write_text(FAKE_CUDA)
    plain = head.submit(["sh", "-c", f"{sys.executable} {script} {3 * GiB} {gate.path} {ready}; echo end"],
                        name="plain", priority="low", mem="4GiB")
    head.until(plain, lambda j: ready.exists() or j["state"] not in ("PENDING", "RUNNING"))
    node = head.job(plain)["node"]
    assert node != kept and ready.exists()
    urgent = head.submit(urgent_gate.hold(), name="urgent", priority="urgent")
    j = head.until(plain, lambda j: j["state"] == "PAUSED")
    # its 3 GiB and its CUDA context, as NVML lists them before the lock
    assert j["parked"] == "ram" and j["mechanism"] == "transparent" and j["parked_bytes"] == 3 * GiB + CTX, j
    assert "frozen transparently (SIMULATED driver)" in j["reason"], j["reason"]
    assert head.state(urgent, "RUNNING")["node"] == node
    gpu = next(g for g in head.client.get("/v1/gpus")["gpus"] if g["node"] == node)
    assert gpu["processes"] == [] or all(p["used_bytes"] < 3 * GiB for p in gpu["processes"]), gpu
    urgent_gate.open()
    assert head.cli("wait", str(urgent)).returncode == 0
    head.until(plain, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    gate.open()
    done = head.state(plain, "COMPLETED")
    assert done["node"] == node and done["preemptions"] == 1
    assert output(base, done).split() == [f"line{i}" for i in range(1, 41)] + ["end"]
    held.open()
    head.state(keep, "COMPLETED")


def test_a_job_on_a_node_is_cancelled_there(head, base):
    gate = Gate(head.home / "cancel.go")        # never opened: only the cancel can end it
    job = head.submit(gate.hold(), name="to-cancel")
    running = head.state(job, "RUNNING")
    r = head.cli("cancel", str(job))
    assert r.returncode == 0, r.stderr
    done = head.state(job, "CANCELLED")
    assert done["node"] == running["node"] and done["signal"] is not None    # its process was killed
    assert "free" in head.cli("gpus").stdout


# -- failures: Ray restarts a killed agent; a killed head is started again --------------------------
@pytest.fixture(scope="module")
def driver(cluster: Cluster) -> Iterator[Any]:
    """This test process as a Ray driver, to find the agents the way the head does (by name)."""
    ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def agents(driver: Any) -> dict[str, Any]:
    """Node name -> its agent's actor handle."""
    out = {}
    for entry in driver.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith("gpuswap-agent-"):
            actor = driver.get_actor(entry["name"], namespace=NAMESPACE)
            out[driver.get(actor.info.remote(), timeout=FACT_TIMEOUT_S)["name"]] = actor
    return out


def agent_pid(driver: Any, actor: Any) -> int:
    """The pid of the process serving `actor` now, once one answers (Ray may be restarting it)."""
    deadline = time.monotonic() + FACT_TIMEOUT_S
    while True:
        try:
            return int(driver.get(actor.info.remote(), timeout=FACT_TIMEOUT_S)["pid"])
        except (driver.exceptions.RayActorError, driver.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _ends_exact_without_a_pause(head: Daemon, job: int, gate: Gate, result: Path, reference: str) -> dict[str, Any]:
    """Let the job finish: it ran once, start to end (no second start), with the result of an
    uninterrupted run."""
    gate.open()
    assert head.cli("wait", str(job)).returncode == 0
    done = head.job(job)
    assert [e["state"] for e in done["events"] if e["kind"] in ("submitted", "started", "completed")] == \
        ["PENDING", "RUNNING", "COMPLETED"]
    assert json.loads(result.read_text())["sha256"] == reference
    return done


def test_an_agent_killed_is_restarted_by_ray_and_its_job_goes_on(head, base, driver, reference_hashes):
    steps = 120
    gate = Gate(head.home / "agent-kill.go")
    job = head.submit(gate.train(head.home / "agent-kill.json", steps), name="survivor")
    running = head.until(job, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 10)
    actor = agents(driver)[running["node"]]
    before = agent_pid(driver, actor)
    os.kill(before, signal.SIGKILL)
    after = agent_pid(driver, actor)          # Ray restarted it on the same node, as the same actor
    assert after != before
    # The job's supervisor outlived its agent; the new agent reads its facts for the head.
    head.until(job, lambda j: (j["step"] or 0) >= running["step"] + 5)
    done = _ends_exact_without_a_pause(head, job, gate, head.home / "agent-kill.json", reference_hashes(steps))
    assert done["node"] == running["node"] and done["preemptions"] == 0


def test_the_head_killed_and_started_again_re_adopts_the_agents_and_their_jobs(head, base, driver,
                                                                                 reference_hashes):
    steps = 120
    gate = Gate(head.home / "head-kill.go")
    job = head.submit(gate.train(head.home / "head-kill.json", steps), name="kept")
    running = head.until(job, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 10)
    pids = {name: agent_pid(driver, a) for name, a in agents(driver).items()}
    head.kill9()
    # The head down: a node's socket says so (exit 69, "daemon unavailable"); the job runs on.
    user = AsUser(*ensure_user("gs-ray-user"))
    code, _, err = user.cli(base / f"agent-{running['node']}", "ls")
    assert code == 69 and "head" in err and "not answering" in err, (code, err)
    head.start()
    head.until(0, lambda g: sorted(x["node"] for x in g["gpus"]) == list(NODES), get="/v1/gpus")
    # The same agents (found by name), not new ones; the job kept running meanwhile.
    assert {name: agent_pid(driver, a) for name, a in agents(driver).items()} == pids
    head.until(job, lambda j: (j["step"] or 0) >= running["step"] + 5)
    _ends_exact_without_a_pause(head, job, gate, head.home / "head-kill.json", reference_hashes(steps))


def _join_and_fill(head: Daemon, base: Path, cluster: Cluster, node: str,
                   tag: str) -> tuple[Any, dict[str, Gate], dict[str, int]]:
    """Add `node` to the cluster, wait until the pool has its GPU, and hold one job on each node's
    GPU; returns the node's handle, and the gate and the job on each node."""
    added = cluster.add_node(**node_args(base, node))
    everyone = sorted(NODES + (node,))
    head.until(0, lambda g: sorted(x["node"] for x in g["gpus"]) == everyone, get="/v1/gpus")
    gates = [Gate(head.home / f"{tag}-{i}.go") for i in range(len(everyone))]
    jobs = [head.submit(g.hold(), name=f"{tag}-{i}") for i, g in enumerate(gates)]
    on = {head.state(j, "RUNNING")["node"]: (g, j) for g, j in zip(gates, jobs)}
    assert sorted(on) == everyone       # one job on each node's GPU
    # RUNNING is recorded before the node's agent spawns the supervisor: wait for the process itself,
    # so a node removed next surely had the job running on it.
    for n, (_, j) in on.items():
        there = Launcher(base / f"agent-{n}", simulated=True, pause_timeout_s=10)
        head.until(j, lambda _j, there=there, j=j: there.observe(j, 1).alive)
    return added, {n: g for n, (g, _) in on.items()}, {n: j for n, (_, j) in on.items()}


# -- membership: a node that joins gets an agent without a restart; one removed leaves ------------
def test_a_node_that_joins_adds_its_gpu_without_a_restart_and_leaves_when_removed(head, base, cluster):
    third, gates, placed = _join_and_fill(head, base, cluster, "node-c", "join")
    jobs = list(placed.values())
    for g in gates.values():
        g.open()
    for j in jobs:
        assert head.cli("wait", str(j)).returncode == 0
    cluster.remove_node(third)
    head.until(0, lambda g: sorted(x["node"] for x in g["gpus"]) == list(NODES), get="/v1/gpus")


# -- a node lost for good: its jobs end FAILED, how they exited unknown; the others go on ------------
def test_a_node_lost_for_good_ends_its_jobs_failed_and_the_others_go_on(head, base, cluster):
    lost, gates, placed = _join_and_fill(head, base, cluster, "node-d", "lost")
    victim = placed["node-d"]
    try:
        cluster.remove_node(lost)        # its raylet and agent gone; Ray reports the node dead
        failed = head.state(victim, "FAILED")
        assert failed["exit_code"] is None and failed["signal"] is None     # not invented
        assert "node node-d is lost" in failed["reason"] and "not known" in failed["reason"], failed["reason"]
        assert failed["node"] == "node-d" and failed["assigned_gpus"] == []
        assert failed["events"][-1]["kind"] == "failed"
        assert [head.job(placed[n])["state"] for n in NODES] == ["RUNNING", "RUNNING"]
        assert not [g for g in head.client.get("/v1/gpus")["gpus"] if g["node"] == "node-d"]
        # Its Ray started again under its name and state directory: the job's supervisor outlived
        # the raylet, so the job still runs there, on a GPU the head counts free. The node's
        # return stops it (node/strays.py); the record stays as it was ended.
        there = Launcher(base / "agent-node-d", simulated=True, pause_timeout_s=10)
        assert there.observe(victim, 1).alive
        back = cluster.add_node(**node_args(base, "node-d"))
        head.until(0, lambda g: "node-d" in [x["node"] for x in g["gpus"]], get="/v1/gpus")
        head.until(victim, lambda j: not there.observe(victim, 1).alive)
        ended = there.observe(victim, 1).status
        assert ended and ended.get("exit"), ended       # its supervisor ended it and said so
        assert head.job(victim)["state"] == "FAILED" and [head.job(placed[n])["state"] for n in NODES] == \
            ["RUNNING", "RUNNING"]
        cluster.remove_node(back)
        head.until(0, lambda g: "node-d" not in [x["node"] for x in g["gpus"]], get="/v1/gpus")
    finally:
        for g in gates.values():
            g.open()         # the lost node's job process outlived its raylet: let it end too
    for n in NODES:
        assert head.cli("wait", str(placed[n])).returncode == 0


# Attached to the runtime, then no safepoint until its gate opens: asked to pause, it stays PAUSING.
NO_SAFEPOINT = """import os, sys, time
import gpuswap
job = gpuswap.attach(epoch=0)
job.safepoint(0)
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def test_a_node_lost_mid_park_ends_the_parking_job_failed(head, base, cluster):
    lost, gates, placed = _join_and_fill(head, base, cluster, "node-f", "mid-park")
    gate = Gate(head.home / "mid-park.go")
    script, attached = head.home / "no_safepoint.py", head.home / "mid-park.attached"
    script.write_text(NO_SAFEPOINT)
    try:
        gates["node-f"].open()                    # node-f's holder ends: the next job takes its GPU
        head.state(placed["node-f"], "COMPLETED")
        job = head.submit([sys.executable, str(script), str(gate.path), str(attached)], name="mid-park")
        head.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and attached.exists())
        assert head.job(job)["node"] == "node-f"
        assert head.cli("pause", str(job)).returncode == 0
        head.until(job, lambda j: j["state"] == "PAUSING")     # it reaches no safepoint: the park waits
        cluster.remove_node(lost)
        failed = head.state(job, "FAILED")
        assert "node node-f is lost" in failed["reason"] and failed["exit_code"] is None, failed["reason"]
        assert failed["parked"] is None and failed["assigned_gpus"] == []
        assert [head.job(placed[n])["state"] for n in NODES] == ["RUNNING", "RUNNING"]
    finally:
        for g in (gate, *gates.values()):
            g.open()
    for n in NODES:
        assert head.cli("wait", str(placed[n])).returncode == 0


def _finish_on_a_node_that_reaches_it(head: Daemon, job: int, gate: Gate, gates: dict[str, Gate]) -> dict[str, Any]:
    """Free the first node's GPU (it reaches the job's checkpoint on the shared storage) and let the
    job finish there: its record, completed on that node."""
    gates[NODES[0]].open()
    gate.open()
    assert head.cli("wait", str(job)).returncode == 0
    done = head.job(job)
    assert done["state"] == "COMPLETED" and done["node"] == NODES[0], done
    return done


def test_a_job_parked_to_disk_on_a_node_lost_for_good_resumes_on_another_exactly(head, base, cluster,
                                                                                 reference_hashes):
    """Its checkpoint is on the storage every node shares: the node's loss costs it nothing."""
    steps = 120
    lost, gates, placed = _join_and_fill(head, base, cluster, "node-e", "lost-disk")
    gate = Gate(head.home / "lost-disk.go")
    job = head.submit(gate.train(head.home / "lost-disk.json", steps), name="lost-disk", priority="low")
    gates["node-e"].open()              # node-e's holder ends: the training job takes its GPU
    head.state(placed["node-e"], "COMPLETED")
    running = head.until(job, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 10)
    assert running["node"] == "node-e"
    assert head.cli("pause", "--to", "disk", str(job)).returncode == 0
    head.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    try:
        cluster.remove_node(lost)
        head.until(0, lambda g: "node-e" not in [x["node"] for x in g["gpus"]], get="/v1/gpus")
        assert head.cli("resume", str(job)).returncode == 0
        done = _finish_on_a_node_that_reaches_it(head, job, gate, gates)
    finally:
        for g in (gate, *gates.values()):
            g.open()
    resumed = next(e for e in done["events"] if e["kind"] == "resume_started")
    assert "moved from node-e" in resumed["reason"], resumed
    assert not any(e["kind"] == "failed" for e in done["events"])
    assert json.loads((head.home / "lost-disk.json").read_text())["sha256"] == reference_hashes(steps)
    assert head.cli("wait", str(placed[NODES[1]])).returncode == 0


def _kill_what_ran_there(agent_home: Path, job: int) -> None:
    """What a node lost for good takes with it: the job's supervisor and processes, a multi-rank
    job's ranks too (torchrun starts each in a session of its own; on this one machine they
    outlive `Cluster.remove_node`; on a dead server they would be gone)."""
    runs = sorted((agent_home / "jobs" / str(job)).glob("run-*"), key=lambda p: int(p.name[4:]))
    status = json.loads((runs[-1] / "status.json").read_text())
    spawned = json.loads((runs[-1] / "spawned.json").read_text())
    ranks = [r.get("pid") for r in status.get("rank_pids") or []]
    for pid in (status.get("job_pid"), spawned.get("pid"), *ranks):
        if pid:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def test_a_running_job_of_a_node_lost_for_good_restarts_from_its_last_disk_checkpoint_exactly(
        head, base, cluster, reference_hashes):
    steps = 120
    lost, gates, placed = _join_and_fill(head, base, cluster, "node-g", "requeue")
    gate = Gate(head.home / "requeue.go")
    job = head.submit(gate.train(head.home / "requeue.json", steps), name="requeue", priority="low")
    gates["node-g"].open()                      # node-g's holder ends: the training job takes its GPU
    head.state(placed["node-g"], "COMPLETED")
    head.until(job, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 10)
    # A disk checkpoint of it: parked to disk by its user, and resumed on node-g (the others are held).
    assert head.cli("pause", "--to", "disk", str(job)).returncode == 0
    step = head.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")["step"]
    assert head.cli("resume", str(job)).returncode == 0
    running = head.until(job, lambda j: j["state"] == "RUNNING" and any(e["kind"] == "restarted_disk"
                                                                       for e in j["events"]))
    assert running["node"] == "node-g"          # it runs on from that step (and holds before its end)
    head.until(job, lambda j: (j["step"] or 0) > step)      # its new process runs: its files are there
    try:
        cluster.remove_node(lost)
        _kill_what_ran_there(base / "agent-node-g", job)
        requeued = head.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
        assert requeued["step"] == step and requeued["assigned_gpus"] == []
        event = next(e for e in reversed(requeued["events"]) if e["kind"] == "requeued")
        assert "node node-g is lost" in event["reason"] and event["state"] == "PAUSED", event
        assert f"requeued from its last disk checkpoint (step {step}," in event["reason"], event
        _finish_on_a_node_that_reaches_it(head, job, gate, gates)
    finally:
        for g in (gate, *gates.values()):
            g.open()
    assert json.loads((head.home / "requeue.json").read_text())["sha256"] == reference_hashes(steps)
    assert head.cli("wait", str(placed[NODES[1]])).returncode == 0


BANDWIDTHS = ("ram_park_bps", "ram_resume_bps", "disk_write_bps", "disk_read_bps")


def test_each_node_is_calibrated_by_its_own_agent_and_gpus_shows_its_figures(head, base, driver):
    """Per-node switch costs (node/nodebandwidths.py): under `--no-calibrate` no node is calibrated;
    the head started again without it asks every node's agent, which times its own disk (in its
    state directory) and RAM tier (a host memcpy: simulated GPUs) on a thread of its own, and
    `/v1/gpus` and `gpuswap gpus` give each node's figures with their sources."""
    def per_node() -> dict[str, Any]:
        return head.client.get("/v1/gpus")["node_bandwidths"]

    before = per_node()
    assert set(NODES) <= set(before), before
    assert all(not f["source"].startswith("calibrated") for n in NODES for f in before[n].values()), before
    head.stop()
    head.args = [a for a in head.args if a != "--no-calibrate"]
    head.start()

    def calibrated(g: dict[str, Any]) -> bool:
        figures = g.get("node_bandwidths") or {}
        return all(n in figures and all(figures[n][f]["source"].startswith("calibrated") for f in BANDWIDTHS)
                   for n in NODES)

    got = head.until(0, calibrated, get="/v1/gpus")["node_bandwidths"]
    mine = agents(driver)
    for n in NODES:
        # The head shows what that node's agent measured, itself (the same figures, to the bit).
        own = driver.get(mine[n].calibration.remote(), timeout=FACT_TIMEOUT_S)
        assert {f: (got[n][f]["bytes_per_s"], got[n][f]["source"]) for f in BANDWIDTHS} == \
            {f: (own[f]["bytes_per_s"], own[f]["source"]) for f in BANDWIDTHS}, (n, got[n], own)
        assert got[n]["disk_write_bps"]["source"] == "calibrated: 128 MiB write+fsync in the home"
        assert got[n]["ram_park_bps"]["source"] == "calibrated: host memcpy, simulated GPU"
        assert all(got[n][f]["bytes_per_s"] > 0 for f in BANDWIDTHS)
        assert not (base / f"agent-{n}" / ".calibration").exists()     # its scratch file is gone
    assert got[NODES[0]]["disk_write_bps"]["bytes_per_s"] != got[NODES[1]]["disk_write_bps"]["bytes_per_s"]
    text = " ".join(head.cli("gpus").stdout.split())      # as one line, however the terminal wrapped it
    shown = {part.split(":")[0]: part for part in text.split("switch bandwidths on ")[1:]}
    assert set(shown) == set(NODES), text
    for n in NODES:
        assert "disk write" in shown[n] and "(calibrated: 128 MiB write+fsync in the home)" in shown[n], text


def test_the_dashboard_names_each_gpu_and_job_by_its_node_in_a_browser(head, base):
    """The web page in a real headless Chromium against the pool's head: every node's GPU as a
    card named node:index (simulated, and saying so), a job's GPUs and its node on its page."""
    why = why_no_browser(CHROMIUM)
    if why:
        pytest.skip(f"BROWSER TESTS NOT RUN: {why}")
    from playwright.sync_api import expect, sync_playwright
    url = "http://" + head.args[head.args.index("--listen") + 1]
    token = head.client.post("/v1/tokens", {"user": None, "note": "pool page"})["token"]
    gate = Gate(head.home / "page.go")
    job = head.submit(gate.hold(), name="on-a-node")
    node = head.state(job, "RUNNING")["node"]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(30_000)
                page.goto(f"{url}/ui/#token={token}")
                for n in NODES:
                    expect(page.locator(f'.gpu[data-gpu="{n}:0"] h3')).to_contain_text(f"GPU {n}:0")
                    expect(page.locator(f'.gpu[data-gpu="{n}:0"]')).to_contain_text("simulated")
                expect(page.locator(f'.gpu[data-gpu="{node}:0"]')).to_contain_text(f"job {job}")
                expect(page.locator(f'#jobs tr[data-job-id="{job}"] .gpus')).to_contain_text(f"[{node}:0]")
                page.screenshot(path=str(base / "pool-page.png"), full_page=True)
                page.goto(f"{url}/ui/#/job/{job}")
                expect(page.locator("#job-facts")).to_contain_text(f"assigned 0 on node {node}")
            finally:
                browser.close()
    finally:
        gate.open()
    assert head.cli("wait", str(job)).returncode == 0


# -- placement by working directory: a node that cannot enter it gets no job of it --------------------
def _start_node_without(base: Path, cluster: Cluster, name: str, hidden: Path) -> Any:
    """A Ray node (`ray start --block`, as on a server) whose processes do not see what is in
    `hidden`: a tmpfs is mounted over it in the node's own mount namespace, as a server lacks another's
    local scratch directory. Its agent, and any job it started, would live in that namespace."""
    unshare, ray_cli = shutil.which("unshare"), Path(sys.executable).parent / "ray"
    if os.geteuid() != 0 or unshare is None or not ray_cli.exists():
        pytest.skip("needs root, unshare(1) and the ray command for a node with its own mounts")
    args = node_args(base, name)
    import subprocess
    cmd = [unshare, "-m", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=1m,mode=0755 gpuswap-test "$1" && shift && exec "$@"', "sh", str(hidden),
           str(ray_cli), "start", "--block", "--address", cluster.address, "--num-cpus", "1",
           "--object-store-memory", str(args["object_store_memory"]), "--resources", json.dumps(args["resources"]),
           "--disable-usage-stats"]
    # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM, Ray (2.60) first drains the node for up
    # to 30 s, until no worker holds a lease; the node's gpuswap agent holds one for good, so every
    # stop waited the whole 30 s. Without the drain the node's processes are stopped at once, as
    # `Cluster.remove_node` stops the other tests' nodes.
    env = {**os.environ, **args["env_vars"], "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    return subprocess.Popen(cmd, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_node(proc: Any) -> None:
    """`ray start --block` stops its node's processes on SIGTERM (at once: no drain, above);
    whatever is left is killed."""
    proc.terminate()
    try:
        proc.wait(FACT_TIMEOUT_S)
    except Exception:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def test_a_job_goes_only_to_nodes_where_its_working_directory_can_be_entered(head, base, cluster):
    proj = base / "scratch" / "proj"              # a lab's local scratch: node-w has none of it
    proj.mkdir(parents=True)
    gates = {n: Gate(head.home / f"workdir-{n}.go") for n in NODES}
    held = {n: head.submit(g.hold(), name=f"workdir-{n}", preemptible=False) for n, g in gates.items()}
    on = sorted(head.state(j, "RUNNING")["node"] for j in held.values())
    assert on == list(NODES)
    # node-w: a name no other test gives a node. Stopped without Ray's drain (_start_node_without), a
    # node's name taken again by a node that joins seconds later could find the pool still holding
    # the old node's agent (pinned to the dead node): the newcomer was taken for lost.
    node_w = _start_node_without(base, cluster, "node-w", proj.parent)
    try:
        head.until(0, lambda g: "node-w" in [x["node"] for x in g["gpus"]], get="/v1/gpus")
        job = head.submit([sys.executable, "-c", "import os; print('ran in', os.getcwd())"], name="workdir",
                          priority="low", cwd=str(proj))
        # node-w's GPU is free, but its kernel says the directory is not there: the job waits, and says so.
        waiting = head.until(job, lambda j: "not on node-w" in j["pending_reason_text"])
        assert waiting["state"] == "PENDING", waiting
        assert f"working directory '{proj}' does not exist" in waiting["pending_reason_text"], waiting
        assert [g["jobs"] for g in head.client.get("/v1/gpus")["gpus"] if g["node"] == "node-w"] == [[]]
        holder = next(n for n in NODES if head.job(held[n])["node"] == n)
        gates[holder].open()                      # a node that can enter it frees its GPU: it runs there
        assert head.cli("wait", str(job)).returncode == 0
        done = head.job(job)
        assert done["node"] == holder and not any(e["kind"] == "failed" for e in done["events"]), done
        assert f"ran in {proj}" in output(base, done)
    finally:
        for g in gates.values():
            g.open()
        _stop_node(node_w)
    head.until(0, lambda g: "node-w" not in [x["node"] for x in g["gpus"]], get="/v1/gpus")
    for j in held.values():
        assert head.cli("wait", str(j)).returncode == 0


def test_a_multi_rank_job_of_a_node_lost_for_good_restarts_from_every_ranks_part_exactly(head, base, cluster):
    """A torchrun job of 2 ranks on a node of 2 GPUs: its disk checkpoint is one part per rank and
    a manifest on the shared storage. Its node lost for good, it goes back to that checkpoint and
    restarts with both ranks on another node of 2 GPUs, ending bitwise equal, rank by rank, to
    plain torchrun (tests/multirank/mr_job.py; only nodes of 2 GPUs can hold it)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "multirank"))
    mr = pytest.importorskip("mr_testing", reason="needs torch with torch.distributed and gloo")
    steps, out, ref = 12, head.home / "mr-lost", head.home / "mr-lost-ref"
    gate = Gate(head.home / "mr-lost.go")
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(mr.reference, ref, 2, steps)     # meanwhile: it shares nothing with the job
        lost = cluster.add_node(**node_args(base, "node-h", "2x80GiB"))
        head.until(0, lambda g: [x["node"] for x in g["gpus"]].count("node-h") == 2, get="/v1/gpus")
        try:
            job = head.submit(mr.torchrun(2, "--steps", str(steps), "--out", str(out), "--gate", str(gate.path),
                                          "--hold-at", "4,8"), name="mr-lost", gpus=2)
            head.until(job, lambda j: j["state"] == "RUNNING" and len(j["ranks"]) == 2
                       and all(r["connected"] for r in j["ranks"]))
            assert head.job(job)["node"] == "node-h"
            # Its disk checkpoint, held at step 4: parked to disk by its user, resumed on node-h.
            assert head.cli("pause", "--to", "disk", str(job)).returncode == 0
            step = head.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")["step"]
            manifest = json.loads(max((base / "shared-ckpt" / str(job)).glob("ckpt-*.json")).read_text())
            assert (manifest["world_size"], manifest["step"], len(manifest["parts"])) == (2, step, 2)
            assert head.cli("resume", str(job)).returncode == 0
            head.until(job, lambda j: j["state"] != "PAUSED")                # placed again: on node-h
            # The other node of 2 GPUs joins while the job restarts there (the one place it fits).
            there = cluster.add_node(**node_args(base, "node-i", "2x80GiB"))
            head.until(job, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) > step and j["node"] == "node-h"
                       and all(r["connected"] for r in j["ranks"]))        # held again at step 8
            cluster.remove_node(lost)
            _kill_what_ran_there(base / "agent-node-h", job)
            # Back to that checkpoint (PAUSED on disk, its ranks' parts written), then on to node-i.
            requeued = head.until(job, lambda j: any(e["kind"] == "requeued" for e in j["events"]))
            event = next(e for e in requeued["events"] if e["kind"] == "requeued")
            assert event["state"] == "PAUSED" and "node node-h is lost" in event["reason"], event
            assert f"requeued from its last disk checkpoint (step {step}," in event["reason"], event
            assert "2 parts, one per rank" in event["reason"], event
            gate.open()
            done = head.state(job, "COMPLETED", "FAILED", timeout=300)
        finally:
            gate.open()
        assert done["state"] == "COMPLETED" and done["node"] == "node-i", done
        resumed = next(e for e in reversed(done["events"]) if e["kind"] == "resume_started")
        assert "moved from node-h" in resumed["reason"], resumed
        assert not any(e["kind"] == "failed" for e in done["events"])
        reference.result()
    cluster.remove_node(there)
    for rank in (0, 1):
        a, b = mr.load(ref / "ddp", rank), mr.load(out / "ddp", rank)
        for key in ("params", "optimizer", "rng", "data"):
            mr.assert_bitwise(a[key], b[key], f"rank {rank} {key}")


def test_retention_forgets_finished_jobs_with_their_files_on_their_nodes(head, base):
    """Last in the module: the head started again with `--retention 1s`. A finished job's record
    goes, and its files go with it on the node that ran it (deleted there by its agent)."""
    job = head.submit(["sh", "-c", "echo kept-until-forgotten"], name="to-forget")
    node = head.state(job, "COMPLETED")["node"]
    job_dir = base / f"agent-{node}" / "jobs" / str(job)
    assert (job_dir / "output.log").read_text().strip() == "kept-until-forgotten"
    head.stop()
    head.args = [*head.args, "--retention", "1s"]
    head.start()

    def forgotten(_: Any) -> bool:
        try:
            head.job(job)
        except ClientError as e:
            return f"no job {job}" in str(e)
        return False

    head.until(0, forgotten, get="/v1/health")
    assert not job_dir.exists()
