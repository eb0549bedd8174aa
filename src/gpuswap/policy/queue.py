"""The waiting jobs in policy order, produced as a round asks for them.

A round usually ends after a few jobs at the head of the queue: once nothing is free, coming free
or lendable and the next job may pause nobody, no later job can be served either. Sorting the whole
queue was then most of a round's work with a deep queue (10,000 jobs: milliseconds on every call),
so the keys are heapified (linear time) and popped one at a time. The order is the sort's exactly:
every key ends with its job's id, unique in a snapshot, so no two keys are equal. The heap holds
the keys themselves, not (key, position) pairs: comparing two pairs compares their keys twice
(for equality, then order). 10,000 of `gpuswap`'s keys heapified and 100 popped took 1.9 ms as
pairs, 1.2 ms as keys with an index from id to job.
"""
from __future__ import annotations

from heapq import heapify, heappop
from typing import Iterator, Optional, Sequence

from gpuswap.policy.model import JobView, Phase


class Queue:
    def __init__(self, jobs: Sequence[JobView], keys: Sequence[tuple]):
        self.jobs, self.keys = jobs, keys
        self._heap = list(keys)
        heapify(self._heap)
        self._last: Optional[tuple] = None                 # the last key taken
        self._in_ram: Optional[list[JobView]] = None

    def __iter__(self) -> Iterator[tuple[tuple, JobView]]:
        """(key, job) from the head of the queue on, each taken out as it is yielded."""
        heap = self._heap
        by_id = {k[-1]: j for k, j in zip(self.keys, self.jobs)}
        while heap:
            self._last = key = heappop(heap)
            yield key, by_id[key[-1]]

    def rest(self, positions: list[int]) -> list[tuple[tuple, JobView]]:
        """The jobs at these positions of `jobs` not yet taken, in order."""
        keys, jobs, last = self.keys, self.jobs, self._last
        left = sorted((keys[i], i) for i in positions if last is None or keys[i] > last)
        return [(k, jobs[i]) for k, i in left]

    def in_ram(self) -> list[JobView]:
        """The RAM-parked jobs in order, taken or not: the only ones a round may spill to make
        room (asked for only when a node runs short; sorted once, far fewer than the queue)."""
        if self._in_ram is None:
            keys, jobs, paused = self.keys, self.jobs, Phase.PAUSED
            ram = [i for i, j in enumerate(jobs) if j.parked == "ram" and j.phase is paused]
            self._in_ram = [jobs[i] for i in sorted(ram, key=keys.__getitem__)]
        return self._in_ram
