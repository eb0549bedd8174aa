"""Trace reading: accepted columns, malformed rows skipped and counted, seeded models."""
import pytest

from gpuswap.jobs import Priority
from gpuswap.sim.trace import GiB, TraceError, load, read_trace


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


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    p = write(tmp_path, "timestamp,duration,num_gpus\n"
                        "2017-10-01 00:00:00,60,1\n"
                        "not-a-date,60,1\n"
                        "2017-10-01 00:01:00,-5,1\n"
                        "2017-10-01 00:02:00,60,0\n"
                        "2017-10-01 00:03:00,60\n")
    t = read_trace(p)
    assert len(t.jobs) == 1 and t.skipped == 4
    assert any("line 3" in m for m in t.problems)


def test_unusable_traces_raise_one_clear_error(tmp_path):
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(str(tmp_path / "missing.csv"))
    with pytest.raises(TraceError, match="lacks required column"):
        read_trace(write(tmp_path, "a,b\n1,2\n"))
    with pytest.raises(TraceError, match="no usable rows; 1 skipped"):
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
