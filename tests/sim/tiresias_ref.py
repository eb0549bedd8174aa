"""A line-by-line port of Tiresias' own simulator's scheduling loops, to check `las` and `fifo` against.

Source: github.com/SymbioticLab/Tiresias, commit 959f9b08f44fa1b4f2b3aed79b01e4d439264a94,
`simulator/` (Python 2.7; Apache-2.0). Not vendored: only the scheduling loops are ported, with
`--scheme=count` placement (the cluster is one pool of GPUs: `cluster.py` L1373-1380
`none_placement`, L94-95 `empty_infra`, L1468-1471 `release_job_res`). Every step below names the
lines it follows (run_sim.py unless said otherwise). Python 2's integer `/` on ints is written
`//`; `sys.maxint` is `MAXINT`. Nothing is "fixed": the quirks stay (one demotion per event; the
demotion wake-up `(limit - executed_time) / num_gpu` mixes GPU-seconds with seconds, so a wide job
that ran before is re-examined late; times are truncated to whole seconds).

Jobs are `(submit, duration, num_gpu)` tuples of ints; the result is each job's JCT
(`log.py` L345: end time - submit time), in input order, plus counters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAXINT = 2**63 - 1

# jobs.py L102-104: three queues; the 18000 limit is never reached (only limits of queues < 2 are read)
QUEUE_LIMIT = (3250, 7200, 18000)
NUM_QUEUE = 3


@dataclass(eq=False)
class _Job:
    idx: int
    submit_time: int
    duration: int
    num_gpu: int
    status: str = "ADDED"
    q_id: int = 0
    start_time: int = MAXINT
    end_time: int = 0
    last_check_time: int = 0
    total_executed_time: int = 0
    executed_time: int = 0
    pending_time: int = 0
    last_pending_time: int = 0
    preempt: int = 0
    resume: int = 0
    promote: int = 0


@dataclass
class Result:
    jct: list[int]
    preempt: int = 0
    promote: int = 0
    events: int = 0
    starts: list[int] = field(default_factory=list)


def _load(jobs) -> list[_Job]:
    """jobs.py L177-185 `add_job` (duration = int(float(...))), L338-349 `sort_all_jobs` (a stable
    sort by submit time: ties keep file order)."""
    out = [_Job(i, int(s), int(float(d)), int(g)) for i, (s, d, g) in enumerate(jobs)]
    return sorted(out, key=lambda j: j.submit_time)


def _start_events(job_list: list[_Job]) -> list[dict]:
    """jobs.py L504-530 `prepare_job_start_events`: one event per distinct submit time."""
    events: list[dict] = []
    by_time: dict[int, dict] = {}
    for job in job_list:
        ev = by_time.get(job.submit_time)         # util.py L20-32 search_dict_list
        if ev is None:
            ev = by_time[job.submit_time] = {"time": job.submit_time, "start_jobs": [], "end_jobs": []}
            events.append(ev)
        ev["start_jobs"].append(job)
        job.status = "EVENT"
    events.sort(key=lambda e: e["time"])
    return events


def dlas_gpu(jobs, num_gpu: int, solve_starvation: float = 0, queue_limit=QUEUE_LIMIT,
             num_queue: int = NUM_QUEUE, *, demoted_ahead: bool = False, fifo_by_submit: bool = False,
             exact_demotion: bool = False) -> Result:
    """`dlas_sim_jobs(gputime=True, solve_starvation)` (L959-1242): `--schedule=dlas-gpu` is
    solve_starvation=0 (no promotion, L2048-2049), `dlas-gpu-2` is 2 (L2079-2080), etc.

    The three keywords are NOT Tiresias: each switches off one detail of how its simulator keeps
    a queue's list, to show that these details, and nothing else, separate it from `las`:
    `demoted_ahead` puts a demoted running job with its new queue's running jobs instead of behind
    that queue's waiting jobs; `fifo_by_submit` orders a queue's waiting jobs by submit time
    instead of moving each preempted job ahead of those that waited longer; `exact_demotion`
    wakes when the service really crosses a threshold (ceil((limit - GPU-seconds) / GPUs)).
    """
    job_list = _load(jobs)
    job_events = _start_events(job_list)
    runnable: list[_Job] = []
    queues: list[list[_Job]] = [[] for _ in range(num_queue)]
    res = Result([0] * len(job_list), starts=[0] * len(job_list))
    end_events: list[dict] = []                                     # L972
    next_job_jump = MAXINT                                          # L973
    while len(job_events) + len(runnable) > 0:                      # L974
        if len(job_events) + len(end_events) == 0:                  # L975-977
            raise RuntimeError("This cluster is not large enough to run the job")
        res.events += 1
        start_event, start_time = None, MAXINT                      # L980-984
        if job_events:
            start_event = job_events[0]
            start_time = start_event["time"]
        end_event, end_time = None, MAXINT                          # L985-989
        if end_events:
            end_event = end_events[0]
            end_time = end_event["time"]
        event_time, event = MAXINT, {"time": MAXINT}                # L991-993
        if end_time < start_time:                                   # L994-996
            event_time, event = end_time, end_event
        elif end_time > start_time:                                 # L997-1000
            event_time, event = start_time, start_event
        elif end_time == start_time and end_time != MAXINT:         # L1001-1005
            event_time, event = start_time, start_event
            event["end_jobs"] = end_events[0]["end_jobs"]
        assert event_time == event["time"]                          # L1007
        if event_time > next_job_jump:                              # L1010-1012: a queue jump first
            event_time, event = next_job_jump, {}

        for e_job in event.get("end_jobs", ()):                     # L1016-1022
            e_job.status = "END"                                    # cluster.py L1468-1472
            e_job.end_time = event_time                             # log.py L343-345
            res.jct[e_job.idx] = event_time - e_job.submit_time
            runnable.remove(e_job)
            queues[e_job.q_id].remove(e_job)

        if "start_jobs" in event:                                   # L1025-1032
            for s_job in event["start_jobs"]:
                s_job.status = "PENDING"                            # jobs.py L432-442 move_to_runnable
                s_job.start_time = MAXINT
                s_job.last_check_time = s_job.submit_time
                s_job.total_executed_time = s_job.executed_time = 0
                s_job.pending_time = s_job.last_pending_time = 0
                runnable.append(s_job)
                s_job.q_id = 0                                      # L1028: any new job is in Q0
                queues[0].append(s_job)
            job_events.pop(0)

        for rjob in runnable:                                       # L1035
            if rjob.status == "RUNNING":                            # L1036-1054
                tmp = int(event_time - rjob.last_check_time)
                rjob.total_executed_time = int(rjob.total_executed_time + tmp)
                rjob.executed_time = int(rjob.executed_time + tmp)
                rjob.last_check_time = event_time
                j_gt = int(rjob.executed_time * rjob.num_gpu)       # L1044-1045 (gputime)
                cur_qid = rjob.q_id
                if cur_qid < int(num_queue - 1):                    # L1049-1053: demote one queue
                    if j_gt >= queue_limit[cur_qid]:
                        rjob.q_id = int(cur_qid + 1)
                        if demoted_ahead:                   # (not Tiresias: see the docstring)
                            new = queues[rjob.q_id]
                            new.insert(next((i for i, x in enumerate(new) if x.status != "RUNNING"),
                                            len(new)), rjob)
                        else:
                            queues[rjob.q_id].append(rjob)
                        queues[cur_qid].remove(rjob)
            elif rjob.status == "PENDING":                          # L1060-1074
                tmp = int(event_time - rjob.last_check_time)
                rjob.last_check_time = event_time
                rjob.pending_time = int(rjob.pending_time + tmp)
                if rjob.executed_time > 0:                          # L1064-1065
                    rjob.last_pending_time = int(rjob.last_pending_time + tmp)
                if (solve_starvation > 0 and rjob.q_id > 0 and rjob.total_executed_time > 0
                        and rjob.executed_time > 0):                # L1067-1074: promote to Q0,
                    if rjob.last_pending_time >= int(rjob.executed_time * solve_starvation):
                        rjob.executed_time = 0                      # its attained service reset
                        rjob.last_pending_time = 0
                        queues[0].append(rjob)
                        queues[rjob.q_id].remove(rjob)
                        rjob.q_id = 0
                        rjob.promote = int(rjob.promote + 1)
                        res.promote += 1

        free_gpu = num_gpu                                          # L1094 empty_infra (cluster.py L95)
        run_jobs: list[_Job] = []                                   # L1096-1097
        preempt_jobs: list[_Job] = []
        for queue in queues:                                        # L1103-1118: queue order, list
            for job in queue:                                       # order inside; fits -> runs
                if free_gpu >= job.num_gpu:
                    if job.status == "PENDING":
                        run_jobs.append(job)
                    free_gpu = int(free_gpu - job.num_gpu)
                else:
                    if job.status == "RUNNING":
                        preempt_jobs.append(job)
                    continue
        for job in preempt_jobs:                                    # L1120-1124
            job.status = "PENDING"
            job.preempt = int(job.preempt + 1)
            res.preempt += 1
        for job in run_jobs:                                        # L1125-1129
            job.status = "RUNNING"
            job.resume = int(job.resume + 1)
            if job.start_time == MAXINT:
                job.start_time = event_time
                res.starts[job.idx] = event_time
        for queue in queues:                                        # L1133-1143: running jobs
            pending_job = [job for job in queue if job.status == "PENDING"]   # first, then the
            for job in pending_job:                                 # pending ones, each in order
                queue.remove(job)
            if fifo_by_submit:                                      # (not Tiresias)
                pending_job.sort(key=lambda j: (j.submit_time, j.idx))
            queue.extend(pending_job)

        del end_events[:]                                           # L1187
        min_end_time = MAXINT                                       # L1203-1217: the next completion
        tmp_end_event: dict = {}
        for rjob in runnable:
            if rjob.status == "RUNNING":
                remaining_time = rjob.duration - rjob.total_executed_time
                end_time = int(event_time + remaining_time)
                if end_time < min_end_time:
                    tmp_end_event = {"time": end_time, "end_jobs": [rjob]}
                    min_end_time = end_time
                elif min_end_time == end_time:
                    tmp_end_event["end_jobs"].append(rjob)
        if min_end_time < MAXINT:
            end_events.append(tmp_end_event)

        next_job_jump = MAXINT                                      # L1220-1238: next demotion or
        for rjob in runnable:                                       # promotion
            if rjob.status == "RUNNING":
                qid = rjob.q_id
                if qid < int(num_queue - 1):                        # L1226: Python 2 int division
                    jump_time = int((queue_limit[qid] - rjob.executed_time) // rjob.num_gpu + event_time)
                    if exact_demotion:                              # (not Tiresias)
                        gpu_s_left = queue_limit[qid] - rjob.executed_time * rjob.num_gpu
                        jump_time = int(-(-gpu_s_left // rjob.num_gpu) + event_time)
                    if jump_time < next_job_jump:
                        next_job_jump = jump_time
            elif rjob.status == "PENDING":
                if (solve_starvation > 0 and rjob.q_id > 0 and rjob.total_executed_time
                        and rjob.executed_time > 0):
                    diff_time = int(rjob.executed_time * solve_starvation - rjob.last_pending_time)
                    if diff_time > 0:
                        jump_time = int(diff_time + event_time)
                        if jump_time < next_job_jump:
                            next_job_jump = jump_time
    return res


def fjf(jobs, num_gpu: int) -> Result:
    """`fit_first_sim_jobs` (L338-395, `--schedule=fjf`): FIFO order, and any job that fits starts
    (backfill) -- the FIFO the `fifo` policy implements. (`--schedule=fifo`, L272-335, stops at the
    first job that does not fit; no gpuswap policy does that.)"""
    job_list = _load(jobs)
    job_events = _start_events(job_list)
    pending_jobs: list[_Job] = []
    free_gpu = num_gpu
    res = Result([0] * len(job_list), starts=[0] * len(job_list))
    while len(job_events) + len(pending_jobs) > 0:                  # L343
        if len(job_events) == 0:                                    # L344-346
            raise RuntimeError("This cluster is not large enough to run the job")
        res.events += 1
        event = job_events[0]                                       # L348-349
        event_time = event["time"]
        for e_job in event["end_jobs"]:                             # L352-359
            free_gpu = min(free_gpu + e_job.num_gpu, num_gpu)       # cluster.py L1468-1471
            e_job.status = "END"
            res.jct[e_job.idx] = event_time - e_job.submit_time     # log.py L343-345
        for s_job in event["start_jobs"]:                           # L363-365 move_to_pending
            s_job.status = "PENDING"                                # (jobs.py L394-396)
            pending_jobs.append(s_job)
        new_start_list = []                                         # L367-380
        for p_job in pending_jobs:
            if free_gpu <= 0:                                       # L370-371 check_free_gpu (count)
                break
            if free_gpu >= p_job.num_gpu:                           # cluster.py L1373-1378
                free_gpu = int(free_gpu - p_job.num_gpu)
                new_start_list.append(p_job)
        for ns_job in new_start_list:                               # L382-384
            ns_job.status = "RUNNING"                               # jobs.py L386-392
            ns_job.start_time = event_time
            ns_job.end_time = ns_job.start_time + ns_job.duration
            res.starts[ns_job.idx] = event_time
            pending_jobs.remove(ns_job)
            ev = next((e for e in job_events if e["time"] == ns_job.end_time), None)   # jobs.py L485-497
            if ev is None:
                ev = {"time": ns_job.end_time, "start_jobs": [], "end_jobs": []}
                job_events.append(ev)
            ev["end_jobs"].append(ns_job)
        job_events.pop(0)                                           # L391-392
        job_events.sort(key=lambda e: e["time"])
    return res
