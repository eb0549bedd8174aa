"""Trace reading: accepted columns, malformed rows skipped and counted, seeded models."""
import time

import pytest

from gpuswap.jobs import Priority
from gpuswap.sim.trace import GiB, TraceError, describe_skipped, load, read_trace


def write(tmp_path, text):
    path = tmp_path / "t.csv"
    path.write_text(text)
    return str(path)


def test_generic_columns_and_optional_fields(tmp_path):
    p = write(tmp_path, "submit_time,duration_s,gpus,user,priority,mem,weight\n"
                        "100,60,2,alice,urgent,20GiB,2\n"
                        "40,30,1,bob,0,,\n")
    t = read_trace(p)
    assert [j.submit for j in t.jobs] == [0.0, 60.0]          # sorted, relative to the first
    bob, alice = t.jobs
    assert (alice.user, alice.priority, alice.mem, alice.weight, alice.gpus) == ("alice", 3, 20 * GiB, 2.0, 2)
    assert (bob.priority, bob.mem, bob.weight) == (0, None, 1.0)


def test_malformed_rows_are_skipped_and_counted_by_reason(tmp_path):
    p = write(tmp_path, "timestamp,duration,num_gpus\n"
                        "2017-10-01 00:00:00,60,1\n"
                        "not-a-date,60,1\n"
                        "2017-10-01 00:01:00,-5,1\n"
                        "2017-10-01 00:02:00,60,0\n"
                        "2017-10-01 00:03:00,60\n"
                        "2017-10-01 00:04:00,nan,1\n"
                        "2017-10-01 00:05:00,x,1\n")
    t = read_trace(p)
    assert len(t.jobs) == 1 and t.skipped == 6
    assert t.skipped_by_reason == {"duration not a positive number": 3, "GPUs not a positive number": 2,
                                   "bad submit time": 1}
    assert t.problems[0] == "duration not a positive number, e.g. line 4: '-5'"
    assert describe_skipped(t) == (
        "skipped 6 malformed row(s): 3 duration not a positive number, e.g. line 4: '-5'; "
        "2 GPUs not a positive number, e.g. line 5: '0'; 1 bad submit time, e.g. line 3: 'not-a-date'")


def test_rows_past_any_real_job_are_skipped_and_counted(tmp_path):
    """1e300 s took every later second into float rounding (a JCT of 0) and overflowed the plots."""
    p = write(tmp_path, "submit,duration,gpus\n0,100,1\n10,1e300,1\n1e300,10,1\n5,10,1e30\n7,20,2\n")
    t = read_trace(p)
    assert [(j.submit, j.duration, j.gpus) for j in t.jobs] == [(0.0, 100.0, 1), (7.0, 20.0, 2)]
    assert t.skipped_by_reason == {"duration over 31 years": 1, "submit time beyond year 33,000": 1,
                                   "GPUs over a million": 1}


def test_fractional_gpu_requests_are_rounded_up_and_counted(tmp_path):
    t = read_trace(write(tmp_path, "submit,duration,gpus\n0,60,0.5\n1,60,1\n2,60,1.25\n3,60,2\n"))
    assert [j.gpus for j in t.jobs] == [1, 1, 2, 2] and t.rounded == 2 and t.skipped == 0
    assert read_trace(write(tmp_path, "submit,duration,gpus\n0,60,1\n1,60,0.5\n"), limit=1).rounded == 0


def test_unknown_class_labels_refuse_the_trace_with_counts(tmp_path):
    """A class column in another vocabulary is not a few bad rows: dropping those rows would
    simulate a different workload, so the trace is refused, each unknown label counted."""
    p = write(tmp_path, "submit,duration,gpus,class\n0,60,1,urgent\n1,60,1,batch\n2,60,1,batch\n"
                        "3,60,1,service\n4,60,1,7\n")
    with pytest.raises(TraceError, match=r"unknown class label\(s\) 'batch' \(2 rows\), "
                                         r"'service' \(1 row\), '7' \(1 row\)"):
        read_trace(p)


def test_date_times_without_a_zone_are_utc_on_every_machine(tmp_path, monkeypatch):
    """Across New York's daylight-saving change (2017-11-05) the two rows are 3 hours apart in
    UTC; read as New York local time they would be 4 hours apart."""
    p = write(tmp_path, "timestamp,duration,num_gpus\n2017-11-05 00:30:00,60,1\n2017-11-05 03:30:00,60,1\n"
                        "2017-11-05 05:30:00+02:00,60,1\n")
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        t = read_trace(p)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert [j.submit for j in t.jobs] == [0.0, 3 * 3600.0, 3 * 3600.0]


def test_unusable_traces_raise_one_clear_error(tmp_path):
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(str(tmp_path / "missing.csv"))
    with pytest.raises(TraceError, match="lacks required column"):
        read_trace(write(tmp_path, "a,b\n1,2\n"))
    with pytest.raises(TraceError, match="no usable rows; 1 skipped \\(bad submit time, e.g. line 2: 'x'\\)"):
        read_trace(write(tmp_path, "submit,duration,gpus\nx,1,1\n"))


def test_models_fill_memory_and_class_reproducibly(tmp_path):
    rows = "".join(f"{i * 10},{100 if i % 2 else 5000},1\n" for i in range(400))
    p = write(tmp_path, "submit,duration,gpus\n" + rows)
    a, b, c = load(p, seed=1, urgent_fraction=0.5), load(p, seed=1, urgent_fraction=0.5), load(p, seed=2, urgent_fraction=0.5)
    assert [j.mem for j in a.jobs] == [j.mem for j in b.jobs] != [j.mem for j in c.jobs]
    assert all(1 * GiB <= j.mem <= 78 * GiB for j in a.jobs)
    urgent = [j for j in a.jobs if j.priority == Priority.URGENT]
    assert all(j.duration <= 900 for j in urgent)
    assert 0.4 < len(urgent) / 200 < 0.6


def test_wide_jobs_are_narrowed_to_a_node_keeping_gpu_time(tmp_path):
    t = load(write(tmp_path, "submit,duration,gpus\n0,100,16\n"), gpus_per_node=8)
    assert (t.jobs[0].gpus, t.jobs[0].duration, t.clamped) == (8, 200.0, 1)


def test_philly_trace_loads(philly_path):
    t = load(philly_path, limit=2000)
    assert len(t.jobs) == 2000 and t.skipped == 0
    assert t.jobs[0].user and all(j.gpus <= 8 for j in t.jobs)
