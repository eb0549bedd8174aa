"""The simulated device's records are read as untrusted bytes (gpuswap/simrecords.py): anything
that is not exactly a record's shape is no record, never an exception."""
from __future__ import annotations

import json

import pytest

from gpuswap.simrecords import DriverRecord, Held, Registration

GOOD = {"pid": 42, "start": 7, "busy": False, "usage_reported": True,
        "held": [{"gpu": 1, "context": 5, "nbytes": 10}, {"gpu": 0, "context": 5, "nbytes": 0}]}


def test_a_registration_round_trips_per_gpu():
    reg = Registration.parse(json.dumps(GOOD).encode())
    assert reg is not None and reg.held == (Held(1, 5, 10), Held(0, 5, 0))
    assert (reg.gpu, reg.nbytes, reg.used) == (1, 10, 20)
    assert Registration.parse(json.dumps(reg.to_json()).encode()) == reg


@pytest.mark.parametrize("bad", [
    b"", b"\xff\xfe", b"[]", b"null", b"{}", b"[" * 100_000,
    json.dumps({**GOOD, "held": []}).encode(),                                    # no GPU
    json.dumps({**GOOD, "held": [GOOD["held"][0]] * 2}).encode(),                 # one GPU twice
    json.dumps({**GOOD, "held": [{"gpu": "0", "context": 5, "nbytes": 1}]}).encode(),
    json.dumps({**GOOD, "held": [{"gpu": 0, "context": 5, "nbytes": 2**60}]}).encode(),
    json.dumps({**GOOD, "held": [{"gpu": 5000, "context": 5, "nbytes": 1}]}).encode(),
    json.dumps({**GOOD, "held": [{"gpu": True, "context": 5, "nbytes": 1}]}).encode(),
    json.dumps({**GOOD, "held": [[0, 5, 1]]}).encode(),
    json.dumps({**GOOD, "held": {"gpu": 0}}).encode(),
    json.dumps({**GOOD, "pid": 1.5}).encode(),
    json.dumps({**GOOD, "busy": "yes"}).encode(),
    json.dumps({"pid": 42, "start": 7, "gpu": 0, "nbytes": 1, "context": 5}).encode(),   # the one-GPU shape
])
def test_a_malformed_registration_is_none(bad):
    assert Registration.parse(bad) is None


def test_a_driver_record_is_its_processes_and_well_formed_or_none():
    rec = DriverRecord("checkpointed", True, ((0, 1), (1, 0)))
    raw = json.dumps(rec.to_json(7)).encode()
    assert DriverRecord.parse(raw, 7) == rec and rec.where(0) == 1 and rec.where(3) == 3
    assert DriverRecord.parse(raw, 8) is None                       # an earlier process with this pid
    for bad in (b"", b"[1]", b"[" * 100_000, json.dumps({"start": 7, "state": "gone"}).encode(),
                json.dumps({"start": 7, "state": "running", "moved": [[0, 1], [1, 1]]}).encode(),
                json.dumps({"start": 7, "state": "running", "moved": [[0, 1, 2]]}).encode(),
                json.dumps({"start": 7, "state": "running", "moved": [["0", 1]]}).encode(),
                json.dumps({"start": 7, "state": "running", "poisoned": 1}).encode()):
        assert DriverRecord.parse(bad, 7) is None
