"""The memory a cooperative RAM park leaves on the GPU (its residue: CUDA context, workspaces, tensors
not attached) stays taken until the parked job resumes or leaves RAM (issue 12, bug 5)."""
from gpuswap.jobs import Priority
from gpuswap.policy import GpuView, Pause, Phase, Resume, Spill, Start, decide, decide_explained
from policy_helpers import GiB, job, kinds, snap

LOW, NORMAL, URGENT = Priority.LOW, Priority.NORMAL, Priority.URGENT
HALF = GiB // 2


def _gpus(n: int, mem_gib: float = 2, kept: dict[int, int] | None = None) -> tuple[GpuView, ...]:
    return tuple(GpuView(i, "n0", int(mem_gib * GiB), residue_bytes=(kept or {}).get(i, 0)) for i in range(n))


def _parked(id="p", home=(0,), residue=HALF, prio=LOW, mem_gib=1.0, **kw):
    kw.setdefault("tiers", frozenset({"ram", "disk"}))
    kw.setdefault("submit", 0)
    return job(id, Phase.PAUSED, prio=prio, parked="ram", parked_bytes=int(mem_gib * GiB), mem_gib=mem_gib,
               node="n0", home_gpus=home, residue_bytes=residue, since=900, last_start=0, attained=10, run_s=10,
               **kw)


def _urgent(mem_gib, id="u"):
    return job(id, prio=URGENT, mem_gib=mem_gib, submit=950, since=950)


def test_a_job_is_not_placed_beside_a_residue_it_does_not_fit_beside():
    p = _parked()
    out = decide(snap(1000, _gpus(2), [p, _urgent(1.8)]), "gpuswap")
    assert Start("u", (1,), "started on n0 GPU 1") in out          # not GPU 0, where 0.5 GiB stays
    fits = decide(snap(1000, _gpus(1), [p, _urgent(1.0)]), "gpuswap")
    assert kinds(fits) == [("Start", "u")] and fits[0].gpus == (0,)  # 1 GiB fits beside it
    unknown = decide(snap(1000, _gpus(1), [p, _urgent(0)]), "gpuswap")
    assert kinds(unknown) == [("Start", "u")]                        # unknown footprint: assumed to fit


def test_a_residue_in_the_way_is_spilled_to_disk_when_the_waiting_job_may_pause_its_holder():
    p = _parked()
    out, waits = decide_explained(snap(1000, _gpus(1), [p, _urgent(1.8)]), "gpuswap")
    assert kinds(out) == [("Spill", "p")] and "too little for job u" in out[0].reason
    w = waits["u"]
    assert w.code == "Residue" and "512.0 MiB" in w.text and "1.8 GiB of its 2.0 GiB" in w.text, w.text
    assert w.numbers["residue_bytes"] == HALF and w.numbers["mem_bytes"] == int(1.8 * GiB)
    # Its home GPU is promised to u meanwhile: p is not resumed there in the same round.
    assert not any(isinstance(d, Resume) for d in out)


def test_no_spill_for_a_job_that_may_not_pause_the_holder_it_waits_with_the_numbers():
    # Same class, and first in the queue: it may not pause p, so it waits (and p, which fits beside
    # its own residue, resumes there).
    same = job("n", prio=LOW, mem_gib=1.8, submit=-10, since=950)
    out, waits = decide_explained(snap(1000, _gpus(1), [_parked(), same]), "priority")
    assert out == [Resume("p", (0,), "resumed on its own GPU 0")]
    w = waits["n"]
    assert w.code == "Residue" and "job p" in w.text and "512.0 MiB" in w.text, w.text
    assert [b.job_id for b in w.blockers] == ["p"] and w.blockers[0].code == "Residue"
    ram_only = _parked(tiers=frozenset({"ram"}))                    # no disk tier: cannot be spilled
    out = decide(snap(1000, _gpus(1), [ram_only, _urgent(1.8)]), "gpuswap")
    assert not any(isinstance(d, (Spill, Start)) for d in out)


def test_a_preemption_whose_ram_park_leaves_too_little_room_parks_the_victim_to_disk_or_is_not_taken():
    def victim(**kw):
        return job("v", Phase.RUNNING, prio=LOW, assigned=(0,), mem_gib=1, residue_bytes=HALF, since=0,
                   attained=1e4, run_s=1e4, **kw)

    assert decide(snap(1000, _gpus(1), [victim(), _urgent(1.8)]), "gpuswap") == [
        Pause("v", "disk", "preempted by job u (urgent)")]
    assert decide(snap(1000, _gpus(1), [victim(), _urgent(1.0)]), "gpuswap") == [
        Pause("v", "ram", "preempted by job u (urgent)")]
    out, waits = decide_explained(snap(1000, _gpus(1), [victim(tiers=frozenset({"ram"})), _urgent(1.8)]), "gpuswap")
    assert out == []
    assert waits["u"].code == "Residue" and "cannot be parked to disk" in waits["u"].text, waits["u"].text


def test_a_pause_in_flight_counts_what_it_will_leave():
    pausing = job("v", Phase.PAUSING, prio=LOW, assigned=(0,), mem_gib=1, residue_bytes=HALF, parked="ram",
                  since=990)
    assert decide(snap(1000, _gpus(1), [pausing, _urgent(1.8)]), "gpuswap") == []
    assert decide(snap(1000, _gpus(2), [pausing, _urgent(1.8)]), "gpuswap") == [
        Start("u", (1,), "started on n0 GPU 1")]


def test_a_parked_jobs_resume_counts_others_residue_on_its_home_gpu_and_its_own_as_its_own():
    alone = _parked("p", mem_gib=1.5)
    assert decide(snap(1000, _gpus(1), [alone]), "priority") == [Resume("p", (0,), "resumed on its own GPU 0")]
    later = _parked("q", mem_gib=0.5, submit=10)                    # parked on the same GPU after p ran there
    out, waits = decide_explained(snap(1000, _gpus(1), [alone, later]), "priority")
    assert out == [Resume("q", (0,), "resumed on its own GPU 0")]  # q fits; p (1.5 + 0.5 + 0.5 GiB) does not
    assert waits["p"].code == "Residue" and "job q" in waits["p"].text, waits["p"].text


def test_the_residue_of_jobs_outside_the_snapshot_is_kept_too():
    out, waits = decide_explained(snap(1000, _gpus(1, kept={0: HALF}), [_urgent(1.8)]), "gpuswap")
    assert out == []
    assert waits["u"].code == "Residue" and "paused by their users" in waits["u"].text, waits["u"].text
    assert kinds(decide(snap(1000, _gpus(1, kept={0: HALF}), [_urgent(1.5)]), "gpuswap")) == [("Start", "u")]
