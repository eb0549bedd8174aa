"""`GET /metrics`: Prometheus exposition, computed at scrape time from the daemon's durable state.

Gauges read the jobs table and the GPU inventory as they are now. Counters and histograms are a
fold over the append-only `events` table (state transitions with their times), so they survive a
daemon restart without being reset: a fresh daemon refolds the log from the start. The fold is
incremental (only new events are read per scrape) and keeps a little state per live job. It reads
each event's kind, tier, mechanism and initiator, never its sentence (rows from before those were
recorded had theirs inferred once, by node/schema.py's version 2).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

import gpuswap
from gpuswap.api.overview import gpu_used, kept_on, ram_budget, ram_by_node
from gpuswap.jobs import ENDED, JobState, Priority
from gpuswap.lifecycle import EventKind
from gpuswap.node.controller import Controller
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.store import Store

SWITCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
_TERMINAL = ENDED


@dataclass
class _Hist:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for le, c in zip([*map(str, self.buckets), "+Inf"], self.counts):
            acc += c
            out.append((le, acc))
        return out


@dataclass
class _JobTrack:
    state: str
    since: float
    submitted: float
    started: bool = False
    pause_by: str = "policy"
    tier: Optional[str] = None
    spill_asked: Optional[float] = None   # when a RAM->disk spill of this parked job was requested
    spill_by: str = "policy"


# A park's labels (mechanism, tier) from the event that recorded it: its kind says where the state
# went and how (gpuswap.lifecycle.IMPLIED); a SIGSTOPped job's memory stays on its GPU.
_PARKED = frozenset({EventKind.PARKED_RAM.value, EventKind.PARKED_DISK.value, EventKind.FROZEN.value,
                     EventKind.SIGSTOPPED.value})
_TO_DISK = frozenset({EventKind.PARKED_DISK.value, EventKind.SPILLED.value})


def _park_kind(kind: Optional[str], tier: Optional[str], mechanism: Optional[str]) -> tuple[str, str]:
    """(mechanism, tier) of a transition into PAUSED, from the event's fields."""
    if kind in _PARKED and tier and mechanism:
        return mechanism, tier
    return "other", "none"


class EventFold:
    """Counters and histograms derived from the events table; `advance` reads what is new."""

    def __init__(self) -> None:
        self.last_id = 0
        self.jobs: dict[int, _JobTrack] = {}
        self.preemptions: dict[tuple[str, str], int] = {}      # policy pauses only
        self.user_pauses: dict[tuple[str, str], int] = {}
        self.spills: dict[str, int] = {}
        self.park = {t: _Hist(SWITCH_BUCKETS) for t in ("ram", "disk")}
        self.resume = {t: _Hist(SWITCH_BUCKETS) for t in ("ram", "disk")}
        self.wait = _Hist(WAIT_BUCKETS)
        self.finished: dict[str, int] = {}
        self._lock = threading.Lock()

    def advance(self, store: Store, upto: Optional[int] = None) -> None:
        """Fold in the events written since the last call, up to event id `upto` (all: None). Page
        by page: the store's lock is taken per page, never held while the fold's is waited for."""
        with self._lock:
            while upto is None or self.last_id < upto:
                rows = store.events_after(self.last_id)
                for row in rows:
                    if upto is not None and row[0] > upto:
                        return
                    self._apply(*row)
                if len(rows) < 10000:
                    return

    def _apply(self, event_id: int, job_id: int, t: float, state: str, reason: str,
               initiator: Optional[str] = None, kind: Optional[str] = None, tier: Optional[str] = None,
               mechanism: Optional[str] = None) -> None:
        self.last_id = event_id
        tr = self.jobs.get(job_id)
        if tr is None:
            self.jobs[job_id] = _JobTrack(state, t, t)
            return
        if state == tr.state:
            if state == "PAUSED":
                self._parked_event(tr, t, kind, initiator)
            return
        prev, since = tr.state, tr.since
        if state == "PAUSING":   # who asked
            tr.pause_by = initiator or "policy"
        elif state == "PAUSED" and prev == "PAUSING":
            mechanism, tier = _park_kind(kind, tier, mechanism)
            counts = self.preemptions if tr.pause_by == "policy" else self.user_pauses
            counts[(mechanism, tier)] = counts.get((mechanism, tier), 0) + 1
            if tier in self.park:
                self.park[tier].observe(t - since)
            tr.tier = tier
        elif state == "RUNNING" and prev == "RESUMING" and tr.tier in self.resume:
            self.resume[tr.tier].observe(t - since)
        elif state == "RUNNING" and prev == "PENDING" and not tr.started:
            self.wait.observe(t - tr.submitted)
        if state == "RUNNING":
            tr.started = True
        tr.state, tr.since = state, t
        if state in _TERMINAL:
            self.finished[state] = self.finished.get(state, 0) + 1
            del self.jobs[job_id]

    def _parked_event(self, tr: _JobTrack, t: float, kind: Optional[str], initiator: Optional[str]) -> None:
        """An event that leaves a parked job PAUSED: a spill from RAM to disk is a tier change.

        It is not a new preemption (the job was already off its GPU), so it is counted in
        `spills` rather than `preemptions`; its request-to-parked time goes to the disk park
        histogram, like a direct park to disk, and the job's tier becomes disk so that its
        restart is counted as a disk resume."""
        if kind == EventKind.SPILL_REQUESTED.value:
            tr.spill_asked, tr.spill_by = t, initiator or "policy"
        elif kind in _TO_DISK and tr.tier != "disk":
            self.spills[tr.spill_by] = self.spills.get(tr.spill_by, 0) + 1
            self.park["disk"].observe(t - (tr.spill_asked if tr.spill_asked is not None else tr.since))
            tr.tier, tr.spill_asked = "disk", None


GPU_STATES = ("free", "running", "resuming", "pausing", "stopped")


def gpu_state(holders: list) -> str:
    """What a GPU is doing, from the jobs assigned to it: computing wins over a transition, which
    wins over a stopped job's memory left on it (SIGSTOP fallback)."""
    states = {j.state for j in holders if j.holds_gpu}
    for s, name in ((JobState.RUNNING, "running"), (JobState.RESUMING, "resuming"), (JobState.PAUSING, "pausing")):
        if s in states:
            return name
    return "stopped" if states else "free"


class GpuswapCollector(Collector):
    def __init__(self, store: Store, controller: Controller, gpus: GpuInventory):
        self.store, self.controller, self.gpus = store, controller, gpus
        self.fold = EventFold()

    def collect(self) -> Iterator[object]:
        # The live jobs and the finished ones (the fold of the events) as of one instant: a job
        # ending between two reads would be in neither count. Only the two short reads hold the
        # store's lock; the fold catches up to that instant's last event after.
        with self.store.at_one_instant():
            live = self.store.list(live_only=True)
            upto = self.store.last_event_id()
        self.fold.advance(self.store, upto)
        devices = self.gpus.list()          # once: a pool node that stops answering mid-scrape disagrees with no series
        info = GaugeMetricFamily("gpuswap_build_info", "gpuswap version and GPU kind", labels=["version", "simulated"])
        info.add_metric([gpuswap.__version__, str(self.gpus.simulated).lower()], 1)
        yield info
        yield from self._gpus(live, devices)
        yield from self._jobs(live, devices)
        yield from self._nodes(live, devices)
        yield from self._fold()

    def _gpus(self, live: list, devices: list) -> Iterator[object]:
        total = GaugeMetricFamily("gpuswap_gpu_memory_total_bytes", "GPU memory", labels=["gpu", "simulated"])
        used = GaugeMetricFamily("gpuswap_gpu_memory_used_bytes",
                                 "GPU memory in use (NVML; simulated GPUs: the simulated device's process list "
                                 "once a process registered there, else what the jobs report)",
                                 labels=["gpu", "simulated"])
        # Every per-GPU series says whether its GPU is simulated, so no dashboard built on one of
        # them can show a simulated GPU as a real one.
        state = GaugeMetricFamily("gpuswap_gpu_state", "1 for the state the GPU is in, 0 for the others "
                                  "(bounded: GPUs x states; job ids are in /v1/gpus and the event log)",
                                  labels=["gpu", "simulated", "state"])
        jobs = GaugeMetricFamily("gpuswap_gpu_jobs", "jobs whose memory is on the GPU", labels=["gpu", "simulated"])
        kept = kept_on(live)
        for g in devices:
            holders = [j for j in live if j.node == g.node and g.index in j.assigned]
            name = str(g.index) if g.node is None else f"{g.node}:{g.index}"    # a pool's: node:index
            lab = [name, str(g.simulated).lower()]
            total.add_metric(lab, g.mem_total)
            used.add_metric(lab, gpu_used(g.mem_used, holders, sum(n for _, n in kept.get((g.node, g.index), []))))
            now = gpu_state(holders)
            for s in GPU_STATES:
                state.add_metric([*lab, s], 1 if s == now else 0)
            jobs.add_metric(lab, sum(1 for j in holders if j.holds_gpu))
        yield from (total, used, state, jobs)

    def _jobs(self, live: list, devices: list) -> Iterator[object]:
        by = GaugeMetricFamily("gpuswap_jobs", "live jobs by state and priority", labels=["state", "priority"])
        counts = {(s.value, p.label): 0 for s in JobState if not s.terminal for p in Priority}
        parked = {"ram": 0, "disk": 0}
        for j in live:
            counts[(j.state.value, Priority(j.priority).label)] += 1
            if j.parked in parked:
                parked[j.parked] += j.parked_bytes
        for (s, p), n in counts.items():
            by.add_metric([s, p], n)
        yield by
        tier = GaugeMetricFamily("gpuswap_parked_bytes", "bytes of GPU state parked, per tier", labels=["tier"])
        for t, n in parked.items():
            tier.add_metric([t], n)
        yield tier
        yield GaugeMetricFamily("gpuswap_ram_budget_bytes", "host RAM parked jobs may hold (a pool: all nodes')",
                                value=ram_budget(self.controller, ram_by_node(self.controller, devices, live)))
        usage = GaugeMetricFamily("gpuswap_fair_share_usage_gpu_seconds",
                                  "decayed GPU-seconds per user (fair share)", labels=["user"])
        for u, v in sorted(dict(self.controller.usage).items()):
            usage.add_metric([u], v)
        yield usage

    def _nodes(self, live: list, devices: list) -> Iterator[object]:
        """A pool's nodes (docs/ray.md): GPUs each lists now and live jobs placed on each, by state.
        Nothing on one machine (its GPUs and jobs carry no node), so its scrape is as it was. A
        node that does not answer lists no GPUs here while its jobs still count on it."""
        nodes = sorted({g.node for g in devices if g.node is not None} | {j.node for j in live if j.node is not None})
        if not nodes:
            return
        # Counts of GPUs are GPUs shown too: each says whether they are simulated (a node that does
        # not answer lists none; it is labelled as the pool's GPUs are).
        gpus = GaugeMetricFamily("gpuswap_node_gpus", "GPUs a pool's node lists now (0: it does not answer)",
                                 labels=["node", "simulated"])
        jobs = GaugeMetricFamily("gpuswap_node_jobs", "live jobs placed on a pool's node, by state",
                                 labels=["node", "state"])
        for n in nodes:
            mine = [g for g in devices if g.node == n]
            sim = any(g.simulated for g in mine) if mine else bool(self.gpus.simulated)
            gpus.add_metric([n, str(sim).lower()], len(mine))
            for s in JobState:
                if not s.terminal and s is not JobState.PENDING:
                    jobs.add_metric([n, s.value], sum(1 for j in live if j.node == n and j.state is s))
        ram = GaugeMetricFamily("gpuswap_node_ram_budget_bytes", "host RAM parked jobs may hold on a pool's node",
                                labels=["node"])
        for r in ram_by_node(self.controller, devices, live):
            ram.add_metric([r["node"]], r["budget"])
        yield from (gpus, jobs, ram)

    def _fold(self) -> Iterator[object]:
        f = self.fold
        with f._lock:
            for name, counts, doc in (
                    ("gpuswap_preemptions", f.preemptions, "jobs the policy paused for others, by mechanism and tier"),
                    ("gpuswap_user_pauses", f.user_pauses, "jobs paused by their owner, by mechanism and tier")):
                c = CounterMetricFamily(name, doc, labels=["mechanism", "tier"])
                for (m, t), n in sorted(counts.items()):
                    c.add_metric([m, t], n)
                yield c
            spills = CounterMetricFamily("gpuswap_spills", "parked jobs moved from RAM to disk, by initiator",
                                         labels=["initiator"])
            for by in ("policy", "user"):
                spills.add_metric([by], f.spills.get(by, 0))
            yield spills
            done = CounterMetricFamily("gpuswap_jobs_finished", "jobs that ended, by final state", labels=["state"])
            for s in sorted(_TERMINAL):
                done.add_metric([s], f.finished.get(s, 0))
            yield done
            for name, hists, doc in (("gpuswap_park_duration_seconds", f.park, "pause request to parked"),
                                     ("gpuswap_resume_duration_seconds", f.resume, "resume start to running")):
                h = HistogramMetricFamily(name, doc, labels=["tier"])
                for t, hist in hists.items():
                    h.add_metric([t], hist.cumulative(), hist.total)
                yield h
            q = HistogramMetricFamily("gpuswap_queue_wait_seconds", "submission to first start")
            q.add_metric([], f.wait.cumulative(), f.wait.total)
            yield q
