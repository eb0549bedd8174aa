"""One rank's handle (runtime/ranks.py) driven directly, its training thread a real thread and
its channel a recorder: the glue between the cursor (rankcursor.py, proved in isolation) and the
hot path's pause flag. No processes, no torch."""
from __future__ import annotations

import threading
from typing import Any

from gpuswap.protocol import records
from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.ranks import RankIdentity, RankJob
from gpuswap_testing import FACT_TIMEOUT_S


class Recorder:
    """Takes the rank's control messages in place of the supervisor's socket."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.cond = threading.Condition()

    def send(self, msg: records.Report) -> bool:
        with self.cond:
            self.sent.append(records.wire(msg))      # what the socket would carry
            self.cond.notify_all()
        return True

    def close(self) -> None:
        pass

    def ops(self) -> list[str]:
        with self.cond:
            return [m["op"] for m in self.sent]

    def until(self, what: str, fact) -> None:
        with self.cond:
            assert self.cond.wait_for(fact, FACT_TIMEOUT_S), f"never happened: {what}; sent {self.sent}"


def test_a_rank_that_held_below_the_target_stops_at_the_target():
    # Rank 1 reaches a flagged safepoint (tick 4) before the target is known and holds; a peer's
    # mark makes the target 5. Released, rank 1 must train on to tick 5 and be ready there, not
    # pass it: a rank that passed the target would block in the next collective while its peers
    # wait ready at the target (a 4-rank bench job hung so until the pause timeout).
    job = RankJob([], RuntimeConfig(job_id="t", control=None, ckpt_dir=None, simulated=False), RankIdentity(1, 2, 1))
    rec = Recorder()
    job._client = rec
    for step in range(3):
        job.safepoint(step)                                    # ticks 1..3, nothing asked
    job._on_message(records.order({"op": "pause", "epoch": 1, "tier": "ram"}))
    assert rec.sent[-1] == {"op": "mark", "epoch": 1, "seen": 3}

    held = threading.Thread(target=job.safepoint, args=(3,))  # tick 4: holds, no target yet
    held.start()
    rec.until("hold at tick 4", lambda: "hold" in [m["op"] for m in rec.sent])
    assert rec.sent[-1]["tick"] == 4
    job._on_message(records.order({"op": "target", "epoch": 1, "tick": 5}))
    held.join()                                                # released below the target: trains on

    at_target = threading.Thread(target=job.safepoint, args=(4,))   # tick 5, the target
    at_target.start()
    rec.until("ready, or the safepoint returned", lambda: "ready" in [m["op"] for m in rec.sent]
              or not at_target.is_alive())
    assert {"op": "ready", "epoch": 1, "tick": 5} in rec.sent, rec.sent
    job._on_message(records.order({"op": "resume", "epoch": 1}))              # withdrawn: everyone trains on
    at_target.join()
    assert rec.ops()[-1] == "resumed" and job.tick == 5
