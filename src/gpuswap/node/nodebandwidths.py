"""A pool's switch-cost figures, node by node (docs/ray.md).

Each node has its own disks, host memory and GPU links, so a park to disk on one node may cost ten
times what it costs on another. The head keeps one `Bandwidths` per node (node/bandwidth.py): the
node's calibration, made by its own agent and reported to the head (`reported`, node/raypool.py),
refined by the real moves made on that node (the controller's Applier folds each move into its
job's node's figures), and kept in SQLite under the node's name, so a head started again keeps
what every node's moves taught it. The policy prices each job's switch with its node's figures
(`Snapshot.node_costs`). A single daemon has none of this: its one `Bandwidths` is its machine's.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Mapping

from gpuswap.node.bandwidth import BandwidthBook, Bandwidths
from gpuswap.policy.model import SwitchCosts


class _NodeBook:
    """One node's rows of the store's bandwidths (a BandwidthBook)."""

    def __init__(self, book: Any, node: str):
        self.book, self.node = book, node

    def load_bandwidths(self) -> dict[str, tuple[float, int]]:
        return self.book.load_bandwidths(self.node)

    def save_bandwidth(self, field: str, bytes_per_s: float, samples: int, now: float) -> None:
        self.book.save_bandwidth(field, bytes_per_s, samples, now, node=self.node)


class NodeBandwidths:
    """`book`: the store (its bandwidths per node); `reported`: node name -> the calibration its
    agent reported (Bandwidths.calibrated()), read again whenever figures are asked for: a report
    is taken in once (a new one, from a node's agent started again, once more)."""

    def __init__(self, book: BandwidthBook, reported: Callable[[], Mapping[str, Any]] = dict):
        self._book, self._reported = book, reported
        self._nodes: dict[str, Bandwidths] = {}
        self._taken: dict[str, Any] = {}       # node -> the report taken in last
        self._lock = threading.Lock()

    def of(self, node: str) -> Bandwidths:
        """`node`'s figures: made on first use, with what its real moves taught before (the store)."""
        with self._lock:
            found = self._nodes.get(node)
            if found is None:
                found = self._nodes[node] = Bandwidths(_NodeBook(self._book, node))
            return found

    def _take_reports(self) -> None:
        for node, figures in list(self._reported().items()):
            with self._lock:
                if self._taken.get(node) is figures:
                    continue
                self._taken[node] = figures
            self.of(node).take_calibration(figures)

    def costs(self, nodes: Iterable[str]) -> dict[str, SwitchCosts]:
        """The policy's costs of each of `nodes` (Snapshot.node_costs)."""
        self._take_reports()
        return {n: self.of(n).costs() for n in nodes}

    def describe(self, nodes: Iterable[str]) -> dict[str, dict[str, dict[str, object]]]:
        """Each node's figures with their sources, for `gpuswap gpus`."""
        self._take_reports()
        return {n: self.of(n).describe() for n in sorted(nodes)}
