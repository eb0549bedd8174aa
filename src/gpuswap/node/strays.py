"""What runs on a pool's node that the head's records say must not: stopped when the node (re)joins.

A node declared lost for good (`--node-lost-after`) has its jobs ended FAILED at the head, but a
node is only lost to the head: its supervisors outlive its raylet and agent, so when its Ray is
started again (joining under its name, with a new node id) those jobs may still be running, on GPUs
the head has since counted free. Each time a node joins the pool, the head compares what runs
there (`Node.live_runs`: every supervisor alive, from the node's own run directories) with its
records, and asks the supervisor of every run of a job it ended, moved, restarted or requeued to
its disk checkpoint (not there, not in that generation, or parked on disk) to cancel it (the same desired-state file every move uses, so asking
twice does no harm). A job's record is written before its supervisor is launched, so a run being
started is never taken for a stray; a run of a job this head has no record of (a head started
on another database) is left alone and logged: killing it would be worse than not knowing it.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from gpuswap.jobs import JobState
from gpuswap.node.pool import Node, Pool
from gpuswap.node.records import JobRecord
from gpuswap.protocol.rundir import Desired

log = logging.getLogger("gpuswap.strays")


class StrayCheck:
    """Remembers which node (by its object: a node that joins again is a new one) was checked."""

    def __init__(self, pool: Pool, record: Callable[[int], Optional[JobRecord]]):
        self.pool, self.record = pool, record
        self._checked: dict[str, Node] = {}

    def run(self) -> list[tuple[str, int, int]]:
        """Check the nodes that joined since the last call; (node, job id, generation) stopped."""
        stopped = []
        nodes = self.pool.nodes()
        for name in [n for n in self._checked if n not in nodes]:
            del self._checked[name]
        for name, node in nodes.items():
            if self._checked.get(name) is node:
                continue
            told = getattr(node, "info", {}).get("name", name)
            if told != name:        # a second machine answering to a taken name: its records are not its
                log.warning("node %s (it calls itself %s): what runs there is not compared with the records",
                            name, told)
                self._checked[name] = node
                continue
            try:
                runs = node.live_runs()
            except Exception as e:       # asked again next tick
                log.warning("node %s: cannot list what runs there (%s)", name, str(e).splitlines()[0][:200] if str(e)
                            else type(e).__name__)
                continue
            failed = False
            for job_id, generation in runs:
                job = self.record(job_id)
                if job is None:          # not this head's (another database?): not ours to stop
                    log.warning("node %s: job %d (generation %d) runs there but this head has no record of it; "
                                "left alone", name, job_id, generation)
                    continue
                on_disk = job.state == JobState.PAUSED and job.parked == "disk"    # parked or requeued: no process
                if not job.state.terminal and not on_disk and job.node == name and job.generation == generation:
                    continue
                why = (f"it is {job.state.value}" if job.state.terminal else "it is parked on disk" if on_disk
                       else f"it is on node {job.node}" if job.node != name else f"its run is generation {job.generation}")
                log.warning("node %s: job %d (generation %d) still runs there, but %s at the head: stopping it",
                            name, job_id, generation, why)
                try:
                    node.set_desired(job_id, generation, Desired(cancel=True))
                except Exception as e:       # asked again next tick: the node stays unchecked
                    log.warning("node %s: could not stop job %d there (%s)", name, job_id, str(e)[:200])
                    failed = True
                    continue
                stopped.append((name, job_id, generation))
            if not failed:
                self._checked[name] = node
        return stopped
