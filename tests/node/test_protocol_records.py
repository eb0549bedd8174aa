"""The typed records of gpuswap.protocol, without processes: what the daemon, the supervisor and the
runtime write reads back the same; what an older supervisor (or a hostile job through it) left in
status.json costs the fields that fail, never the record; the wire bytes stay what they were."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpuswap
from gpuswap.node.launcher import Observation
from gpuswap.protocol import channel, env, messages, records, rundir
from gpuswap.protocol.env import JobEnv
from gpuswap.protocol.status import (ExitFacts, RankFact, RuntimeFacts, SupervisorReport, SupervisorStatus,
                                     runtime_facts)
from gpuswap.protocol.bounds import MAX_TEXT
from gpuswap.protocol.records import Pause, Resume, encode
from gpuswap.protocol.rundir import Desired, Spawned, Spec
from gpuswap.runtime.config import RuntimeConfig

SRC = Path(gpuswap.__file__).parent

# What the single-rank supervisor folds into status.json["runtime"] after a hello, a RAM park and
# a failed spill (node/supervisor.py's on_message), and a multi-rank one's (runtime/ranktable.py's facts).
SINGLE = {"connected": True, "attached": True, "state": "paused", "tier": "ram", "pid": 4242,
          "device_bytes": 0, "bytes": 3 << 30, "step": 120, "restored_step": 100, "restored_bytes": 1 << 30,
          "restore_s": 0.5, "restore_note": "ckpt-000002 skipped: bad checksum", "pause_s": 1.25,
          "error": "disk full", "error_at": 1_700_000_000.5, "rejected": 3}
MULTI = {"state": "checkpointed", "phase": "checkpointed", "world_size": 2, "attached": True, "connected": False,
         "device_bytes": 0, "tier": "disk", "bytes": 20, "ckpt_path": "/ck/ckpt-000001.json", "step": 5,
         "group_teardown_s": 0.25, "ckpt_note": "RAM park refused: an FSDP1 module", "restored_seq": 4,
         "not_pausable": "rank 1 finished training", "target_tick": 6, "epoch": 1,
         "ranks": [{"rank": 0, "pid": 11, "connected": False, "state": "written", "tick": 6, "step": 5,
                    "device_bytes": 0, "ram_refusal": "an FSDP1 module"},
                   {"rank": 1, "pid": 12, "connected": False, "state": "gone", "tick": 6, "step": 5,
                    "device_bytes": 0, "ram_refusal": None}]}


@pytest.mark.parametrize("written", [SINGLE, MULTI])
def test_runtime_facts_read_back_what_the_supervisor_wrote(written):
    facts = runtime_facts(json.loads(json.dumps(written)))      # through the file's JSON
    for name, value in written.items():
        if name in RuntimeFacts.model_fields:
            got = getattr(facts, name)
            if name == "ranks":
                got = [r.model_dump() for r in got]
            assert got == value, name
    assert facts.multi_rank == (written is MULTI)
    assert not hasattr(facts, "target_tick")          # the coordinator's own fields: not the daemon's


def test_absent_runtime_facts_are_none():
    for raw in ({}, None, [], "running", 7):
        facts = runtime_facts(raw)
        assert all(getattr(facts, name) is None for name in RuntimeFacts.model_fields), raw
        assert not facts.multi_rank


@pytest.mark.parametrize("field, bad", [
    ("device_bytes", 2**64), ("device_bytes", -1), ("device_bytes", "1GiB"), ("bytes", 1.5),
    ("state", "exploded"), ("tier", "tape"), ("attached", "yes"), ("connected", 1),
    ("pid", 0), ("pid", 2**40), ("restore_s", float("inf")), ("pause_s", -1.0), ("pause_s", True),
    ("error_at", 1e300), ("ckpt_path", "/x" * 4096), ("world_size", 5000), ("world_size", 0),
    ("restored_seq", 0), ("error", 7), ("ranks", [{"rank": 0, "device_bytes": 2**60}]),
    ("ranks", [{"rank": 0}] * 1025), ("ranks", {"0": {"rank": 0}}), ("step", "7"),
])
def test_a_hostile_field_is_dropped_the_others_kept(field, bad):
    """An older supervisor copied the job's values into status.json unchecked: the field that fails
    is None, and every other field of the record still reads."""
    facts = runtime_facts(dict(SINGLE, **{field: bad}))
    assert getattr(facts, field) is None
    for name, value in SINGLE.items():
        if name != field:
            assert getattr(facts, name) == value, name


def test_long_texts_are_cut_not_dropped():
    facts = runtime_facts({"error": "e" * 10_000, "restore_note": "n" * 10_000, "phase": "p" * 10_000})
    assert facts.error == "e" * MAX_TEXT and facts.phase == "p" * MAX_TEXT
    assert 0 < len(facts.restore_note) < 10_000


def test_what_the_supervisor_writes_the_daemon_reads(tmp_path):
    st = SupervisorStatus(job_id=7, generation=1, supervisor_pid=10, started_at=1.0)
    # the keys of a fresh status.json, as every release wrote them
    assert set(st.to_json()) == {"job_id", "generation", "supervisor_pid", "job_pid", "started_at", "runtime",
                                 "stopped", "exit"}
    assert SupervisorReport.parse(st.to_json()) == SupervisorReport(runtime=RuntimeFacts(connected=False,
                                                                                         attached=False))
    st.job_pid, st.job_start_ticks, st.stopped = 1234, 99, True
    st.runtime.update(SINGLE)
    st.exit = ExitFacts(code=75, signal=None, error=None, time=5.0)
    st.rank_pids = [{"rank": 0, "pid": 11, "start_ticks": 3}]
    (tmp_path / rundir.STATUS).write_text(json.dumps(st.to_json()))
    got = SupervisorReport.parse(json.loads((tmp_path / rundir.STATUS).read_text()))
    assert got == SupervisorReport(job_pid=1234, job_start_ticks=99, stopped=True, exit=st.exit,
                                   runtime=runtime_facts(SINGLE), rank_pids=((11, 3),))
    assert st.to_json()["exit"] == {"code": 75, "signal": None, "error": None, "time": 5.0}


def test_status_json_of_an_older_supervisor_still_reads():
    """Written before job_start_ticks and rank_pids existed, with a field since dropped."""
    old = {"job_id": 3, "generation": 1, "supervisor_pid": 99, "job_pid": 1234, "started_at": 1.0,
           "runtime": {"connected": True, "attached": True, "state": "running", "device_bytes": 5},
           "stopped": False, "exit": {"code": 75, "signal": None, "time": 12.5}, "something_old": [1, 2]}
    report = SupervisorReport.parse(old)
    assert (report.job_pid, report.job_start_ticks, report.stopped, report.rank_pids) == (1234, None, False, ())
    assert report.exit == ExitFacts(code=75, signal=None, error=None, time=12.5)
    assert report.runtime.device_bytes == 5 and report.runtime.state == "running"
    obs = Observation(old, True, 0.0)
    assert (obs.job_pid, obs.exit.code, obs.runtime.attached, obs.stopped, obs.rank_pids) == (1234, 75, True, False, [])


def test_a_hostile_status_json_gives_an_empty_report_field_by_field():
    raw = {"job_pid": 2**40, "job_start_ticks": -5, "stopped": "yes", "runtime": ["not", "a", "dict"],
           "exit": {"code": 2**40, "signal": 300, "error": 5, "time": "soon"},
           "rank_pids": [{"pid": 5, "start_ticks": 9}, {"pid": "x"}, {"pid": 2**40}, 7, {"pid": 6, "start_ticks": -1}]}
    report = SupervisorReport.parse(raw)
    assert (report.job_pid, report.job_start_ticks, report.stopped) == (None, None, False)
    assert report.exit == ExitFacts()
    assert report.runtime == RuntimeFacts()
    assert report.rank_pids == ((5, 9), (6, None))
    for junk in (None, [], "x", 3):
        assert SupervisorReport.parse(junk) == SupervisorReport()
        assert Observation(junk, False, None).exit is None


def test_desired_round_trip_and_the_keys_an_older_supervisor_reads(tmp_path):
    d = Desired(run="paused", tier="ram", sigstop=False, cancel=False, max_bytes=1 << 30)
    rundir.write(tmp_path, rundir.DESIRED, d)
    raw = json.loads((tmp_path / rundir.DESIRED).read_text())
    # the keys (and values) every released supervisor reads with d.get(...)
    assert raw == {"run": "paused", "tier": "ram", "sigstop": False, "cancel": False, "max_bytes": 1 << 30}
    assert rundir.read_desired(tmp_path) == d and d.pause_tier == "ram"
    assert Desired.from_json({"run": "running"}) == Desired()     # what launch wrote before
    assert Desired.from_json({"run": "paused", "tier": None}).pause_tier is None
    assert Desired.from_json({"run": "hibernating", "tier": "nvme"}) == Desired(tier="nvme")   # a newer daemon's
    assert rundir.read_desired(tmp_path / "none") is None


@pytest.mark.parametrize("raw", [None, [], "paused", 3, {}, {"run": 5}, {"tier": 3}, {"sigstop": 1},
                                 {"sigstop": "no"}, {"cancel": "false"}, {"max_bytes": "9"}, {"max_bytes": True}])
def test_a_desired_json_no_daemon_writes_is_no_wish_not_its_defaults(tmp_path, raw):
    # Its defaults would resume, continue or stop the job by accident ("sigstop": "no" stopped it).
    with pytest.raises(ValueError):
        Desired.from_json(raw)
    (tmp_path / rundir.DESIRED).write_text(json.dumps(raw))
    assert rundir.read_desired(tmp_path) is None      # the daemon writes its record again


def test_spec_and_spawned_round_trip(tmp_path):
    spec = Spec(job_id=7, generation=2, argv=["python", "train.py"], cwd="/home/u", env={"A": "1"},
                extra_env=JobEnv(job_id="7", control="/h/jobs/7/run-2/control").to_env(), uid=1000, gid=1000,
                log_path="/h/jobs/7/output.log", control="/h/jobs/7/run-2/control", groups=[1000, 27],
                pause_timeout_s=90.0)
    rundir.write(tmp_path, rundir.SPEC, spec)
    assert rundir.read_spec(tmp_path) == spec
    older = {k: v for k, v in spec.to_json().items() if k not in ("groups", "pause_timeout_s")}
    assert Spec.from_json(dict(older, retired_field=1)) == Spec(**older, groups=[], pause_timeout_s=60.0)
    rundir.write(tmp_path, rundir.SPAWNED, Spawned(pid=321, time=5.5))
    assert rundir.read_spawned(tmp_path) == Spawned(pid=321, time=5.5)
    assert Spawned.from_json({"pid": 1}) is None and rundir.read_spawned(tmp_path / "none") is None


@pytest.mark.parametrize("given", [
    JobEnv(job_id="12", control="/h/jobs/12/run-1/control", ckpt_dir="/h/jobs/12/ckpt"),
    JobEnv(job_id="3", control="@peer", ckpt_dir="/c", simulated=True, sim_cuda_dir="/h/simulated-driver"),
    JobEnv(),
])
def test_job_env_is_what_the_runtime_reads_back(given):
    assert JobEnv.from_env(given.to_env()) == given
    config = RuntimeConfig.from_env(given.to_env())
    assert (config.job_id, config.control, config.ckpt_dir, config.simulated) == \
        (given.job_id, given.control, given.ckpt_dir, given.simulated)


def test_job_env_empty_and_zero_are_unset():
    got = JobEnv.from_env({env.JOB_ID: "", env.CONTROL: "", env.SIMULATED: "0", env.SIM_CUDA_DIR: ""})
    assert got == JobEnv()
    assert JobEnv.from_env({env.SIMULATED: "yes"}).simulated


def test_the_supervisors_requests_keep_their_bytes():
    """A runtime of the previous release reads these lines (a job keeps running across an upgrade)."""
    assert encode(Pause(tier="ram", max_bytes=5)) == b'{"op":"pause","tier":"ram","max_bytes":5}\n'
    assert encode(Pause(tier="disk")) == b'{"op":"pause","tier":"disk"}\n'
    assert encode(Resume()) == b'{"op":"resume"}\n'


def test_every_environment_name_in_the_source_is_defined_in_protocol_env():
    defined = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)}
    used = set()
    for path in SRC.rglob("*.py"):
        used |= set(re.findall(r"\"(GPUSWAP_[A-Z0-9_]+)\"", path.read_text()))
    assert used and used <= defined, sorted(used - defined)
    assert not [p for p in SRC.rglob("*.py") if p.name != "env.py"
                and re.search(r"^\w+ = \"GPUSWAP_", p.read_text(), re.M)], "a name defined outside protocol/env.py"


def test_a_rank_fact_is_the_record_show_prints():
    r = RankFact(rank=1, pid=12, state="parked", device_bytes=5)
    assert runtime_facts({"ranks": [r.model_dump()]}).ranks == (r,)


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("package, below", [
    ("protocol", ("gpuswap.node", "gpuswap.runtime", "gpuswap.policy", "gpuswap.api", "gpuswap.cli")),
    ("runtime", ("gpuswap.node", "gpuswap.api", "gpuswap.cli")),
])
def test_layers_point_down_to_the_protocol(package, below):
    """The runtime shares what it shares with the daemon's side through the protocol (and the rank
    table, processes.py), never by importing node/; the protocol imports neither."""
    bad = sorted(f"{path.relative_to(SRC)}: {name}" for path in (SRC / package).rglob("*.py")
                 for name in _imports(path) if name.startswith(below))
    assert not bad, bad


# -- the channel's messages: one record per kind (protocol/records.py) -------------------------------
SHA = "ab" * 32
REPORTS = [
    records.Hello(pid=4242, device_bytes=5 << 20, restored_step=99, restored_bytes=1 << 30, restore_s=0.5,
                  restore_note="ckpt-000002 skipped: bad checksum", job_id="12", parked=False),
    records.Hello(pid=11, rank=1, world_size=2, local_rank=1, state="parked", epoch=3,
                  ram_refusal="an FSDP1 module", restored_seq=9, parked=True),
    records.Usage(device_bytes=7, step=3, parked=False, reserved_bytes=1 << 21),
    records.Paused(tier="ram", bytes=3 << 30, seconds=1.25, step=120),
    records.Paused(epoch=2, tier="ram", bytes=10, seconds=0.5, step=4, group_s=0.25),
    records.Resumed(bytes=3 << 30, seconds=0.75),
    records.Resumed(epoch=2, bytes=10, seconds=0.5, group_s=0.125),
    records.Checkpointed(path="/ck/ckpt-000003.pt", bytes=99, seconds=2.5, step=7, note="over the RAM budget"),
    records.Error(message="park to ram failed: out of memory"),
    records.Error(epoch=4, message="passed the common step 7"),
    records.RestoreFailed(message="cannot resume: no usable checkpoint"),
    records.Mark(epoch=1, seen=0),
    records.Hold(epoch=1, tick=8),
    records.Ready(epoch=1, tick=8, step=41),
    records.Unparked(epoch=1, bytes=10, seconds=0.5),
    records.Part(epoch=1, file="ckpt-000009.r1.pt", bytes=20133, sha256=SHA, seconds=0.1),
    records.Committed(epoch=1, seq=9, path="/ck/ckpt-000009.json", bytes=40266, step=41),
    records.Done(step=100),
    records.Preempt(signal="SIGUSR2"),
]
ORDERS = [
    records.Pause(tier="ram", max_bytes=1 << 30), records.Pause(tier="disk"), records.Pause(epoch=3, tier="ram"),
    records.Resume(), records.Resume(epoch=3), records.Target(epoch=3, tick=9), records.Park(epoch=3, tier="disk"),
    records.Commit(epoch=3, tick=9, parts=(records.PartRef(file="ckpt-000009.r0.pt", bytes=5, sha256=SHA, seconds=0.5,
                                                            rank=0),
                                            records.PartRef(file="ckpt-000009.r1.pt", bytes=6, sha256=SHA, rank=1))),
    records.Exit(epoch=3), records.Regroup(epoch=3, rebuild=False), records.Release(epoch=3),
]


def test_every_kind_of_message_has_a_case_here():
    assert {type(r) for r in REPORTS} == set(records.REPORTS.values())
    assert {type(o) for o in ORDERS} == set(records.ORDERS.values())
    assert set(records.REPORTS) == messages.OPS and not set(records.REPORTS) & set(records.ORDERS)


@pytest.mark.parametrize("report", REPORTS, ids=lambda r: r.op)
def test_a_report_reads_back_through_the_gate_as_it_was_sent(report):
    line = records.encode(report)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert messages.parse(line.rstrip(b"\n")) == report


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: o.op)
def test_an_order_reads_back_in_the_runtime_as_it_was_sent(order):
    line = records.encode(order)
    assert records.order(json.loads(line)) == order


# What the previous release's runtime wrote, literally (dicts, None values included), and what its
# supervisor and coordinator wrote: a job and a supervisor outlive a daemon upgrade in either order.
OLD_REPORTS = [
    ({"op": "hello", "pid": 4242, "device_bytes": 0, "restored_step": None, "restored_bytes": 0, "restore_s": None,
      "restore_note": None, "job_id": "12", "parked": False},
     records.Hello(pid=4242, restored_bytes=0, job_id="12")),
    ({"op": "hello", "pid": 11, "device_bytes": 0, "restored_step": 5, "restored_bytes": 100, "restore_s": 0.5,
      "restore_note": None, "job_id": "12", "parked": True, "rank": 1, "world_size": 2, "local_rank": 1,
      "state": "parked", "epoch": 3, "ram_refusal": None, "restored_seq": 4},
     records.Hello(pid=11, restored_step=5, restored_bytes=100, restore_s=0.5, job_id="12", parked=True, rank=1,
                   world_size=2, local_rank=1, state="parked", epoch=3, restored_seq=4)),
    ({"op": "usage", "device_bytes": 7, "step": None, "parked": False, "reserved_bytes": 1 << 21},
     records.Usage(device_bytes=7, parked=False, reserved_bytes=1 << 21)),
    ({"op": "paused", "tier": "ram", "bytes": 10, "seconds": 0.5, "step": 3},
     records.Paused(tier="ram", bytes=10, seconds=0.5, step=3)),
    ({"bytes": 10, "seconds": 0.5, "step": 3, "group_s": 0.25, "op": "paused", "epoch": 2, "tier": "ram"},
     records.Paused(epoch=2, tier="ram", bytes=10, seconds=0.5, step=3, group_s=0.25)),
    ({"op": "resumed", "bytes": 0, "seconds": 0.0}, records.Resumed(bytes=0, seconds=0.0)),
    ({"op": "checkpointed", "path": "/ck/ckpt-000003.pt", "bytes": 99, "seconds": 2.5, "step": 7},
     records.Checkpointed(path="/ck/ckpt-000003.pt", bytes=99, seconds=2.5, step=7)),
    ({"op": "error", "message": "unknown pause tier 'tape'"}, records.Error(message="unknown pause tier 'tape'")),
    ({"op": "restore_failed", "message": "cannot resume: x"}, records.RestoreFailed(message="cannot resume: x")),
    ({"op": "mark", "epoch": 1, "seen": 3}, records.Mark(epoch=1, seen=3)),
    ({"file": "ckpt-000009.r0.pt", "bytes": 5, "sha256": SHA, "seconds": 0.1, "op": "part", "epoch": 1},
     records.Part(epoch=1, file="ckpt-000009.r0.pt", bytes=5, sha256=SHA, seconds=0.1)),
    ({"seq": 9, "path": "/ck/ckpt-000009.json", "bytes": 5, "step": 4, "op": "committed", "epoch": 1},
     records.Committed(epoch=1, seq=9, path="/ck/ckpt-000009.json", bytes=5, step=4)),
    ({"op": "done", "step": None}, records.Done()),
    ({"op": "preempt", "signal": "SIGTERM"}, records.Preempt(signal="SIGTERM")),
]
OLD_ORDERS = [
    (b'{"op":"pause","tier":"ram","max_bytes":5}', records.Pause(tier="ram", max_bytes=5)),
    (b'{"op":"pause","epoch":1,"tier":"disk"}', records.Pause(epoch=1, tier="disk")),
    (b'{"op":"resume","epoch":1}', records.Resume(epoch=1)),
    (b'{"op":"target","epoch":1,"tick":9}', records.Target(epoch=1, tick=9)),
    (b'{"op":"park","epoch":1,"tier":"ram"}', records.Park(epoch=1, tier="ram")),
    (b'{"op":"commit","epoch":1,"tick":9,"parts":[{"file":"ckpt-000009.r0.pt","bytes":5,"sha256":"' + SHA.encode()
     + b'","seconds":0.1,"rank":0}]}',
     records.Commit(epoch=1, tick=9, parts=(records.PartRef(file="ckpt-000009.r0.pt", bytes=5, sha256=SHA,
                                                            seconds=0.1, rank=0),))),
    (b'{"op":"exit","epoch":1}', records.Exit(epoch=1)),
    (b'{"op":"regroup","epoch":1,"rebuild":true}', records.Regroup(epoch=1)),
    (b'{"op":"release","epoch":1}', records.Release(epoch=1)),
]


@pytest.mark.parametrize("old, record", OLD_REPORTS, ids=lambda x: x.get("op") if isinstance(x, dict) else "")
def test_a_report_in_the_old_literal_form_reads_and_the_new_one_keeps_its_keys(old, record):
    assert messages.parse(channel.encode(old).rstrip(b"\n")) == record
    # What this release sends an older supervisor (or a tool that reads the channel): the same keys
    # with the same values, nulls included.
    assert records.wire(record) == old


@pytest.mark.parametrize("line, record", OLD_ORDERS, ids=lambda x: "" if isinstance(x, bytes) else x.op)
def test_an_order_in_the_old_literal_form_reads_and_the_new_one_is_the_same_bytes(line, record):
    assert records.order(json.loads(line)) == record
    assert records.encode(record) == line + b"\n"


# Per kind: fields that cost the message (the gate refuses it, the supervisor counts it).
HOSTILE = [
    ("hello", {"pid": 0}), ("hello", {"pid": 2**40}), ("hello", {"device_bytes": -1}), ("hello", {"parked": "yes"}),
    ("hello", {"restore_s": float("inf")}), ("hello", {"restored_bytes": "1GiB"}), ("hello", {"state": "dancing"}),
    ("hello", {"rank": 1024, "world_size": 2}), ("hello", {"restored_seq": 0}), ("hello", {"restore_note": 5}),
    ("usage", {"device_bytes": 2**60}), ("usage", {"device_bytes": True}), ("usage", {"device_bytes": 1.5}),
    ("paused", {"tier": "tape"}), ("paused", {"seconds": -1}), ("paused", {"bytes": "10"}), ("paused", {"epoch": -1}),
    ("paused", {"group_s": float("nan")}),
    ("resumed", {"bytes": -5}), ("resumed", {"seconds": "0.5"}), ("resumed", {"group_s": 1e300}),
    ("checkpointed", {"path": "/" + "x" * 5000}), ("checkpointed", {"bytes": None}), ("checkpointed", {"note": ["x"]}),
    ("error", {"message": 7}), ("error", {"epoch": 2**40}),
    ("restore_failed", {"message": None}), ("restore_failed", {"message": {"x": 1}}),
    ("mark", {"epoch": 1}), ("mark", {"epoch": 1, "seen": -1}), ("hold", {"epoch": 1, "tick": 1.5}),
    ("ready", {"epoch": "1", "tick": 1}), ("unparked", {}), ("unparked", {"epoch": 1, "bytes": 2**60}),
    ("part", {"epoch": 1, "file": "../ckpt-000009.r1.pt", "bytes": 1, "sha256": SHA}),
    ("part", {"epoch": 1, "file": "ckpt-000009.r1.pt", "bytes": 1, "sha256": SHA.upper()}),
    ("committed", {"epoch": 1, "seq": 0, "path": "/ck/x.json"}), ("committed", {"epoch": 1, "seq": 3}),
    ("done", {"step": None, "op": 5}), ("preempt", {"signal": "S" * 17}), ("preempt", {"signal": 15}),
    ("pause", {"tier": "ram"}), ("no such op", {}),
]


@pytest.mark.parametrize("op, fields", HOSTILE, ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_a_hostile_field_costs_the_message_never_the_reader(op, fields):
    with pytest.raises(messages.BadMessage):
        messages.parse(json.dumps({"op": op, **fields}).encode())


def test_fields_the_gate_forgives_cost_only_themselves():
    """The user's step is informational (a bad one is dropped), texts are cut, and what no
    supervisor reads (job_id, usage's parked and reserved_bytes) is dropped when it is wrong."""
    assert messages.parse(b'{"op":"paused","bytes":1,"step":"7"}') == records.Paused(bytes=1)
    assert messages.parse(b'{"op":"done","step":1e300}') == records.Done()
    assert messages.parse(b'{"op":"ready","epoch":1,"tick":2,"step":3.0}') == records.Ready(epoch=1, tick=2, step=3)
    assert messages.parse(json.dumps({"op": "error", "message": "e" * 9000}).encode()).message == "e" * MAX_TEXT
    assert messages.parse(b'{"op":"hello","job_id":["x"],"pid":5}') == records.Hello(pid=5)
    assert messages.parse(b'{"op":"usage","device_bytes":1,"parked":"no","reserved_bytes":-1}') == \
        records.Usage(device_bytes=1)
    assert messages.parse(b'{"op":"usage","device_bytes":1,"from_the_future":{"x":1}}') == records.Usage(device_bytes=1)


@pytest.mark.parametrize("raw", [
    {"op": "target", "epoch": 1}, {"op": "target", "epoch": 1, "tick": True}, {"op": "target", "epoch": 1, "tick": "9"},
    {"op": "pause", "tier": 5}, {"op": "pause", "tier": "ram", "max_bytes": 1.5}, {"op": "park", "epoch": 1},
    {"op": "regroup", "epoch": 1, "rebuild": 0}, {"op": "commit", "epoch": 1, "parts": {"0": {}}},
    {"op": "commit", "epoch": 1, "parts": [{"file": "f", "bytes": 1, "sha256": "s"}]},      # no rank
    {"op": "commit", "epoch": 1, "parts": ["f"]}, {"op": "exit"}, {"op": "release", "epoch": [1]},
    {"op": "hello"}, {"op": "no such op"}, {"epoch": 1}, ["pause"],
])
def test_an_order_the_runtime_cannot_read_is_dropped(raw):
    assert records.order(raw) is None


def test_the_records_load_without_pydantic():
    """The runtime builds its messages at `attach`, in the user's process: no pydantic there."""
    code = ("import sys, gpuswap.protocol.records, gpuswap.runtime.handle, gpuswap.runtime.client, "
            "gpuswap.runtime.ranks, gpuswap.runtime.agreement; "
            "sys.exit('pydantic' in sys.modules or 'pydantic_core' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
