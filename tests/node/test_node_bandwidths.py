"""A pool's switch-cost figures per node (node/nodebandwidths.py) in a real SQLite store: a node's
calibration, as its agent reports it, is taken in once and read as untrusted; real moves on a node
refine that node's figures alone, are kept under its name and survive a head restart; and a
single daemon's figures (node '') are not touched by any of it."""
from __future__ import annotations

from gpuswap.node.bandwidth import MIN_OBSERVED_BYTES, Bandwidths
from gpuswap.node.nodebandwidths import NodeBandwidths
from gpuswap.node.store import Store
from gpuswap.policy.model import SwitchCosts


def _report(write: float, read: float) -> dict:
    return {"disk_write_bps": {"bytes_per_s": write, "source": "calibrated: 128 MiB write+fsync in the home"},
            "disk_read_bps": {"bytes_per_s": read, "source": "calibrated: 128 MiB read in the home"}}


def test_each_node_keeps_its_calibration_and_its_own_moves_across_a_restart(tmp_path):
    store = Store(tmp_path / "state.db")
    reports = {"node-a": _report(2e9, 4e9), "node-b": _report(1e8, 2e8)}
    nodes = NodeBandwidths(store, lambda: reports)
    costs = nodes.costs(["node-a", "node-b"])
    assert (costs["node-a"].disk_write_bps, costs["node-b"].disk_write_bps) == (2e9, 1e8)
    assert nodes.costs(["node-a"])["node-a"] is costs["node-a"]      # unchanged: the same object
    described = nodes.describe(["node-b", "node-a"])
    assert list(described) == ["node-a", "node-b"]
    assert described["node-b"]["disk_read_bps"] == {"bytes_per_s": 2e8, "source": "calibrated: 128 MiB read in the home",
                                                    "samples": 0}
    assert described["node-b"]["ram_park_bps"]["source"] == "default"
    # A real park to disk on node-b: its figure, not node-a's, and kept under its name.
    nodes.of("node-b").observe("disk_write_bps", 64 * MIN_OBSERVED_BYTES, 10.0)
    got = nodes.describe(["node-a", "node-b"])
    assert got["node-b"]["disk_write_bps"]["source"] == "measured: 1 real move(s)"
    assert got["node-a"]["disk_write_bps"]["bytes_per_s"] == 2e9
    assert set(store.load_bandwidths("node-b")) == {"disk_write_bps"} and store.load_bandwidths("node-a") == {}
    assert store.load_bandwidths() == {}          # the single daemon's own row set is untouched
    store.close()

    store = Store(tmp_path / "state.db")          # the head started again; node-b's agent reports again
    again = NodeBandwidths(store, lambda: {"node-b": _report(5e7, 5e7)})
    b = again.describe(["node-b"])["node-b"]
    assert b["disk_write_bps"]["source"] == "learned: 1 real move(s) before the last restart"   # beats calibration
    assert b["disk_read_bps"]["bytes_per_s"] == 5e7
    store.close()


def test_a_report_is_taken_in_once_and_what_is_not_a_calibration_is_dropped(tmp_path):
    store = Store(tmp_path / "state.db")
    reports: dict = {"n": {"disk_write_bps": {"bytes_per_s": 3e9, "source": "calibrated: 128 MiB write+fsync"},
                           "disk_read_bps": {"bytes_per_s": float("nan"), "source": "calibrated: read"},
                           "ram_park_bps": {"bytes_per_s": 1e15, "source": "calibrated: host memcpy"},
                           "ram_resume_bps": {"bytes_per_s": 1e10, "source": "measured: 9 real move(s)"},
                           "group_rebuild_s": {"bytes_per_s": 1.0, "source": "calibrated: ?"},
                           "not_a_field": {"bytes_per_s": 1.0, "source": "calibrated: ?"}}}
    nodes = NodeBandwidths(store, lambda: reports)
    d = nodes.describe(["n"])["n"]
    base = SwitchCosts()
    assert d["disk_write_bps"]["bytes_per_s"] == 3e9
    assert [d[f]["bytes_per_s"] for f in ("disk_read_bps", "ram_park_bps", "ram_resume_bps")] == [
        base.disk_read_bps, base.ram_park_bps, base.ram_resume_bps]
    assert d["group_rebuild_s"]["seconds"] == base.group_rebuild_s
    nodes.of("n")._set("disk_write_bps", 1.0, "calibrated: changed since")   # a figure changed here...
    nodes.describe(["n"])                                                      # ...is not overwritten by the old report
    assert nodes.of("n").m["disk_write_bps"].value == 1.0
    reports["n"] = {"disk_write_bps": {"bytes_per_s": 4e9, "source": "calibrated: again"}}    # a new report is
    assert nodes.costs(["n"])["n"].disk_write_bps == 4e9
    assert Bandwidths().take_calibration(["not", "a", "dict"]) == []
    store.close()
