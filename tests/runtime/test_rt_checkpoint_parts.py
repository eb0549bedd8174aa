"""The multi-rank checkpoint format (`gpuswap-ckpt/2`, runtime/ckparts.py) and what goes in
which part (runtime/rankstate.py), without processes: atomicity (no manifest, no checkpoint;
orphan parts ignored, then cleaned), checksums (a flipped byte in any part refuses that
checkpoint on every rank and falls back), world-size refusal, pruning order, format 1 still read.
The real multi-process round trip is tests/multirank/test_disk_parts.py."""
from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch

from gpuswap import fsutil
from gpuswap.protocol.env import ADOPT_CHECKPOINTS, RESTART_ON_BAD_CHECKPOINT
from gpuswap.runtime import checkpoint, ckparts, rankstate, rng
from gpuswap.runtime.objects import classify


def _payload(rank: int, world: int, step: int, value: float) -> dict:
    return {"format": ckparts.FORMAT, "rank": rank, "world_size": world, "step": step, "tick": step,
            "job_id": "j", "shared": {}, "own": {}, "user_state": {"v": value, "rank": rank},
            "rng": rng.capture()}


def _commit(d, world: int, step: int, value: float, parts_only: bool = False) -> list[dict]:
    """Every rank writes its part (as the ranks would, each computing the same seq), then rank 0
    commits, unless `parts_only` (a crash before the manifest)."""
    seq = ckparts.next_seq(d)
    parts = []
    for r in reversed(range(world)):             # rank 0 last: its seq must not see the others
        assert ckparts.next_seq(d) == seq
        parts.append(ckparts.write_part(d, _payload(r, world, step, value)))
    if not parts_only:
        ckparts.write_manifest(d, parts, step=step, tick=step, world_size=world, job_id="j")
    return parts


def _chosen_value(d, rank: int, world: int) -> tuple[float, str | None]:
    chosen, note = ckparts.choose(d, rank, world)
    assert chosen is not None
    assert chosen.own["rank"] == rank and chosen.shared["rank"] == 0
    return chosen.own["user_state"]["v"], note


def test_part_report_and_manifest(tmp_path):
    parts = _commit(tmp_path, 2, step=5, value=1.0)
    assert sorted(p["rank"] for p in parts) == [0, 1]
    for p in parts:
        assert set(p) == {"rank", "file", "bytes", "sha256", "seconds"}   # what agreement._on_part forwards
        assert p["file"] == f"ckpt-000001.r{p['rank']}.pt"
        assert (tmp_path / p["file"]).stat().st_size == p["bytes"]
    doc = json.loads((tmp_path / "ckpt-000001.json").read_text())
    assert doc["format"] == "gpuswap-ckpt/2" and doc["seq"] == 1 and doc["world_size"] == 2
    assert doc["step"] == 5 and doc["tick"] == 5 and doc["job_id"] == "j"
    assert [p["rank"] for p in doc["parts"]] == [0, 1]
    assert set(doc["parts"][0]) == {"rank", "file", "bytes", "sha256"}
    for r in (0, 1):
        assert _chosen_value(tmp_path, r, 2) == (1.0, None)
    assert not [e for e in tmp_path.iterdir() if fsutil.is_temp(e.name) or e.name.startswith(".tmp-")]


def test_no_manifest_means_the_previous_checkpoint_stands_and_orphans_go(tmp_path):
    _commit(tmp_path, 2, step=3, value=1.0)
    orphans = _commit(tmp_path, 2, step=7, value=2.0, parts_only=True)   # rank 0 died before the manifest
    (tmp_path / ".ckpt-000002.r1.pt.999.tmp").write_bytes(b"half a part")  # a rank killed mid-write
    (tmp_path / ".tmp-ckpt-000002.r0.pt.998").write_bytes(b"half a part")  # ... by an older release
    for r in (0, 1):
        assert _chosen_value(tmp_path, r, 2) == (1.0, None)   # silently: orphans are not checkpoints
    # The next checkpoint reuses seq 2 (no manifest took it); its commit leaves no orphan behind.
    assert ckparts.next_seq(tmp_path) == 2
    new = ckparts.write_part(tmp_path, _payload(0, 1, 9, 3.0))
    ckparts.write_manifest(tmp_path, [new], step=9, tick=9, world_size=1)
    names = sorted(e.name for e in tmp_path.iterdir())
    assert names == ["ckpt-000001.json", "ckpt-000001.r0.pt", "ckpt-000001.r1.pt",
                     "ckpt-000002.json", "ckpt-000002.r0.pt"], names
    assert (tmp_path / "ckpt-000002.r0.pt").stat().st_size == new["bytes"]
    assert orphans[0]["sha256"] != new["sha256"]


@pytest.mark.parametrize("bad_rank", [0, 1, 2])
def test_a_flipped_byte_in_any_part_refuses_it_on_every_rank(tmp_path, bad_rank):
    _commit(tmp_path, 3, step=3, value=1.0)
    parts = _commit(tmp_path, 3, step=7, value=2.0)
    path = tmp_path / next(p["file"] for p in parts if p["rank"] == bad_rank)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    for r in range(3):           # every rank reaches the same verdict, not only the owner
        value, note = _chosen_value(tmp_path, r, 3)
        assert value == 1.0
        assert "used seq 1 (step 3)" in note and "sha256" in note and path.name in note


def test_a_missing_part_refuses_the_checkpoint(tmp_path):
    _commit(tmp_path, 2, step=3, value=1.0)
    parts = _commit(tmp_path, 2, step=7, value=2.0)
    (tmp_path / parts[0]["file"]).unlink()            # parts[0] is rank 1's
    value, note = _chosen_value(tmp_path, 0, 2)
    assert value == 1.0 and "missing" in note


def test_world_size_mismatch_is_refused_with_the_reason(tmp_path, monkeypatch):
    _commit(tmp_path, 4, step=3, value=1.0)
    monkeypatch.delenv(RESTART_ON_BAD_CHECKPOINT, raising=False)
    with pytest.raises(checkpoint.NoUsableCheckpoint, match="checkpoint written by 4 ranks, the job now has 2"):
        ckparts.choose(tmp_path, 0, 2)
    chosen, note = ckparts.choose(tmp_path, 1, 2, env={RESTART_ON_BAD_CHECKPOINT: "1"})
    assert chosen is None and "restarted from step 0" in note and "4 ranks" in note
    # the single-rank reader refuses it the same way
    with pytest.raises(checkpoint.NoUsableCheckpoint, match="written by 4 ranks, the job now has 1"):
        checkpoint.choose(tmp_path, env={})


def test_format_1_still_read_and_refused_by_a_multi_rank_job(tmp_path):
    payload = {"format": checkpoint.FORMAT, "step": 4, "objects": {}, "user_state": {"v": 9.0},
               "rng": rng.capture()}
    checkpoint.write_checkpoint(tmp_path, payload, 4)
    info, loaded, note = checkpoint.choose(tmp_path, env={})
    assert info.seq == 1 and loaded["user_state"] == {"v": 9.0} and note is None
    with pytest.raises(checkpoint.NoUsableCheckpoint, match="written by 1 rank, the job now has 2"):
        ckparts.choose(tmp_path, 0, 2, env={})
    # a multi-rank checkpoint after it is the newest; the single-rank job falls back past it
    _commit(tmp_path, 2, step=8, value=2.0)
    assert _chosen_value(tmp_path, 1, 2) == (2.0, None)
    info, loaded, note = checkpoint.choose(tmp_path, env={})
    assert info.seq == 1 and "written by 2 ranks, the job now has 1" in note


def test_pruning_keeps_two_and_removes_manifests_before_parts(tmp_path, monkeypatch):
    for step in (1, 2):
        _commit(tmp_path, 2, step=step, value=float(step))
    removed: list[str] = []
    real_unlink = pathlib.Path.unlink

    def unlink(self, missing_ok=False):
        removed.append(self.name)
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    _commit(tmp_path, 2, step=3, value=3.0)
    assert removed == ["ckpt-000001.json", "ckpt-000001.r0.pt", "ckpt-000001.r1.pt"] or \
        removed == ["ckpt-000001.json", "ckpt-000001.r1.pt", "ckpt-000001.r0.pt"], removed
    assert sorted(e.name for e in tmp_path.iterdir()) == [
        "ckpt-000002.json", "ckpt-000002.r0.pt", "ckpt-000002.r1.pt",
        "ckpt-000003.json", "ckpt-000003.r0.pt", "ckpt-000003.r1.pt"]
    assert _chosen_value(tmp_path, 1, 2) == (3.0, None)


def test_single_rank_prune_also_removes_old_multi_rank_checkpoints(tmp_path):
    _commit(tmp_path, 2, step=1, value=1.0)
    for step in (2, 3):
        checkpoint.write_checkpoint(tmp_path, {"format": checkpoint.FORMAT, "step": step, "objects": {},
                                               "user_state": {}, "rng": {}}, step)
    assert sorted(e.name for e in tmp_path.iterdir()) == [
        "ckpt-000002.json", "ckpt-000002.pt", "ckpt-000003.json", "ckpt-000003.pt"]


@pytest.mark.parametrize("bad", [
    lambda ps: ps[:1],                                               # a rank's part missing
    lambda ps: [dict(ps[0], bytes=ps[0]["bytes"] + 1), ps[1]],       # a size that is not on disk
    lambda ps: [dict(ps[0], file="../ckpt-000001.r0.pt"), ps[1]],    # a path, not a part name
    lambda ps: [dict(ps[0], rank=1), ps[1]],                         # a rank twice
])
def test_a_bad_commit_writes_no_manifest(tmp_path, bad):
    parts = sorted(_commit(tmp_path, 2, step=1, value=1.0, parts_only=True), key=lambda p: p["rank"])
    with pytest.raises(checkpoint.CheckpointError):
        ckparts.write_manifest(tmp_path, bad(parts), step=1, tick=1, world_size=2)
    assert not list(tmp_path.glob("*.json"))
    assert ckparts.choose(tmp_path, 0, 2) == (None, None)


# -- what goes in which part ------------------------------------------------------------------

@pytest.fixture
def one_rank_group(tmp_path):
    """A real (world size 1) gloo group, so DDP and ZeroRedundancyOptimizer can be built here;
    the parts of a 2-rank job are then written as rank 0 and as rank 1 from this process."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("no torch.distributed with gloo")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp_objects(seed: int):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return ddp, opt, sched, torch.Generator().manual_seed(seed)


def _step(ddp, opt, sched, gen, n: int) -> None:
    for _ in range(n):
        ddp(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_ddp_layout_rank0_holds_the_replicated_state_once(one_rank_group, tmp_path):
    ddp, opt, sched, gen = _ddp_objects(0)
    _step(ddp, opt, sched, gen, 3)
    local = torch.optim.SGD(list(ddp.parameters())[:1], lr=0.1)    # over part of the DDP: per rank
    items = [classify("model", ddp), classify("optimizer", opt), classify("scheduler", sched),
             classify("gen", gen), classify("partial", local)]
    assert rankstate.layout(items) == {"model": "split", "optimizer": "shared", "scheduler": "own",
                                       "gen": "own", "partial": "own"}
    shared, own = rankstate.split(items, 1, lambda t: t.detach().clone())
    assert shared == {}                                  # nothing replicated leaves rank 1
    assert set(own["model"]["state"]) == {"module.1.running_mean", "module.1.running_var",
                                          "module.1.num_batches_tracked"}   # buffers: per rank
    assert own["optimizer"]["state"] is None
    shared0, _ = rankstate.split(items, 0, lambda t: t.detach().clone())
    assert set(shared0) == {"model", "optimizer"}
    assert "module.0.weight" in shared0["model"]["state"]


def test_parts_restore_in_place_bitwise_on_each_rank(one_rank_group, tmp_path):
    ddp, opt, sched, gen = _ddp_objects(0)
    _step(ddp, opt, sched, gen, 3)
    items = [classify("model", ddp), classify("optimizer", opt), classify("scheduler", sched),
             classify("gen", gen)]
    parts = []
    for r in (1, 0):
        random.seed(20 + r), torch.manual_seed(30 + r)            # each rank has its own RNG
        with torch.no_grad():                                     # and its own BatchNorm stats
            ddp.module[1].running_mean.fill_(float(r))
        payload = rankstate.part_payload(items, {"epoch": r}, rank=r, world_size=2, step=3, tick=3,
                                         job_id="j", to_host=lambda t: t.detach().cpu().clone())
        parts.append(ckparts.write_part(tmp_path, payload))
    ckparts.write_manifest(tmp_path, parts, step=3, tick=3, world_size=2)
    draws = {r: None for r in (0, 1)}
    for r in (0, 1):
        random.seed(20 + r), torch.manual_seed(30 + r)
        draws[r] = (random.random(), torch.rand(2))
    _step(ddp, opt, sched, gen, 2)                                # what rank 0 would do next
    want = {k: v.clone() for k, v in ddp.state_dict().items()}

    for r in (1, 0):
        ddp2, opt2, sched2, gen2 = _ddp_objects(99)               # a fresh start: other weights
        items2 = [classify("model", ddp2), classify("optimizer", opt2), classify("scheduler", sched2),
                  classify("gen", gen2)]
        state: dict = {}
        done = rankstate.restore_latest(str(tmp_path), None, items2, state, r, 2)
        assert (done.seq, done.step, done.start_step) == (1, 3, 4)
        assert state == {"epoch": r}
        assert float(ddp2.module[1].running_mean[0]) == float(r)
        got = (random.random(), torch.rand(2))
        assert got[0] == draws[r][0] and torch.equal(got[1], draws[r][1])
        if r == 0:
            _step(ddp2, opt2, sched2, gen2, 2)
            for k, v in ddp2.state_dict().items():
                assert torch.equal(v, want[k]), k


def test_zero_optimizer_saves_its_local_shard(one_rank_group, tmp_path):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    for _ in range(2):
        ddp(torch.randn(5, 4)).sum().backward()
        zero.step()
    zero.param_groups[0]["lr"] = 0.5                      # as a scheduler would
    items = [classify("model", ddp), classify("optimizer", zero)]
    assert rankstate.layout(items)["optimizer"] == "zero"
    payload = rankstate.part_payload(items, {}, rank=0, world_size=1, step=1, tick=1, job_id=None,
                                     to_host=lambda t: t.detach().clone())
    ckparts.write_manifest(tmp_path, [ckparts.write_part(tmp_path, payload)], step=1, tick=1, world_size=1)
    want = {k: v.clone() for k, v in zero.optim.state_dict()["state"][0].items()}

    torch.manual_seed(1)
    ddp2 = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    zero2 = ZeroRedundancyOptimizer(ddp2.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    rankstate.restore_latest(str(tmp_path), None, [classify("model", ddp2), classify("optimizer", zero2)], {}, 0, 1)
    got = zero2.optim.state_dict()["state"][0]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert zero2.param_groups[0]["lr"] == 0.5 and zero2.optim.param_groups[0]["lr"] == 0.5


def test_a_ram_park_reaches_the_zero_optimizers_shard(one_rank_group):
    """ZeroRedundancyOptimizer's own `state` is empty (its shard's state lives in the local
    optimizer, `zero.optim`): the tensors a park copies out must include that state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from gpuswap.runtime import objects

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    ddp(torch.randn(5, 4)).sum().backward()
    zero.step()
    assert not zero.state and zero.optim.state          # the case: nothing at the top level
    found = {id(t) for t in objects.iter_tensors([classify("optimizer", zero)])}
    shard = [t for st in zero.optim.state.values() for t in st.values() if torch.is_tensor(t)]
    assert shard and all(id(t) in found for t in shard)


def _buckets_of(ddp) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


class _Unordered(torch.nn.Module):
    """Layers registered in another order than used: the rebuilt buckets differ from DDP's first."""

    def __init__(self) -> None:
        super().__init__()
        self.out, self.inp, self.mid = torch.nn.Linear(48, 4), torch.nn.Linear(16, 48), torch.nn.Linear(48, 48)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


@pytest.mark.parametrize("iterations", [2, 3])   # 2: DDP logs the rebuilt layout one step late
def test_ddp_bucket_layout_is_recorded_and_given_back(one_rank_group, iterations):
    from gpuswap.runtime import ddpbuckets

    def net():
        torch.manual_seed(0)
        return torch.nn.parallel.DistributedDataParallel(_Unordered(), bucket_cap_mb=0.004)

    ddp = net()
    assert ddpbuckets.layout(ddp) is None                # nothing rebuilt before training
    for _ in range(iterations):
        ddp(torch.randn(4, 16)).sum().backward()
    saved = ddpbuckets.layout(ddp)
    assert saved == _buckets_of(ddp) and len(saved) == 2
    fresh = net()
    assert _buckets_of(fresh) != saved                   # one bucket, as DDP starts
    assert ddpbuckets.apply(fresh, saved) is None
    assert _buckets_of(fresh) == saved
    fresh(torch.randn(4, 16)).sum().backward()           # the new Reducer reduces
    assert all(p.grad is not None for p in fresh.parameters())


def test_a_checkpoint_that_does_not_fit_ends_with_restore_failed(one_rank_group, tmp_path, capsys):
    ddp, opt, sched, gen = _ddp_objects(0)
    items = [classify("model", ddp), classify("optimizer", opt)]
    payload = rankstate.part_payload(items, {}, rank=0, world_size=1, step=1, tick=1, job_id=None,
                                     to_host=lambda t: t.detach().clone())
    ckparts.write_manifest(tmp_path, [ckparts.write_part(tmp_path, payload)], step=1, tick=1, world_size=1)
    other = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))   # another model now
    with pytest.raises(SystemExit) as ended:
        rankstate.restore_latest(str(tmp_path), None, [classify("model", other)], {}, 0, 1)
    assert ended.value.code == 1
    assert "cannot resume: rank 0:" in capsys.readouterr().err


def test_a_multi_rank_checkpoint_of_another_job_is_refused_on_every_rank_unless_adopted(tmp_path):
    """Two jobs given one checkpoint directory: the newest checkpoint there is job "j"'s, so job
    "k" would have resumed j's state. Every rank refuses it alike (each rank decides alone, and a
    mix would hang the job); naming j in GPUSWAP_ADOPT_CHECKPOINTS continues j's training."""
    _commit(tmp_path, 2, 7, 1.5)
    for rank in (0, 1):
        with pytest.raises(checkpoint.ForeignCheckpoint, match=r"written by job j, not by this job \(k\)"):
            ckparts.choose(tmp_path, rank, 2, env={RESTART_ON_BAD_CHECKPOINT: "1"}, job_id="k")
        chosen, _ = ckparts.choose(tmp_path, rank, 2, env={ADOPT_CHECKPOINTS: "j"}, job_id="k")
        assert chosen is not None and chosen.own["user_state"]["v"] == 1.5
        mine, _ = ckparts.choose(tmp_path, rank, 2, env={}, job_id="j")
        assert mine is not None and mine.info.step == 7
