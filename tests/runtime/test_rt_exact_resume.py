"""End to end: the demo training job as a real subprocess under a real control socket, paused
to ram and disk (exit 75, restart from the checkpoint), must finish bitwise equal to a run
that was never interrupted."""
from __future__ import annotations

from gpuswap_rt_peer import DEMO_STEPS, finish, job_env, read_result, start_train

from gpuswap.jobs import REQUEUE_EXIT_CODE

STEP_TIME = 0.02


def _pause_ram_and_resume(peer) -> dict:
    peer.send({"op": "pause", "tier": "ram"})
    paused = peer.expect("paused")
    assert paused["tier"] == "ram" and paused["bytes"] > 0
    peer.send({"op": "resume"})
    resumed = peer.expect("resumed")
    assert resumed["bytes"] == paused["bytes"]
    return paused


def test_paused_ram_and_disk_many_times_ends_bitwise_equal(peer, tmp_path, baseline):
    ckpt, out, gate = tmp_path / "ckpt", tmp_path / "result.json", tmp_path / "go"
    env = job_env(peer, ckpt)

    # run 1: ram, ram, then a disk pause while parked in ram (a spill) -> exit 75
    proc = start_train(out, DEMO_STEPS, STEP_TIME, env, gate)
    hello = peer.expect("hello")
    assert hello["restored_step"] is None and hello["pid"] == proc.pid
    p1 = _pause_ram_and_resume(peer)
    peer.send({"op": "pause", "tier": "ram"})
    p2 = peer.expect("paused")
    assert p2["step"] > p1["step"]
    peer.send({"op": "pause", "tier": "ram"})  # already parked: ignored
    usage = peer.expect("usage")  # heartbeat while parked: nothing on the device
    assert usage["parked"] is True and usage["device_bytes"] == 0
    peer.send({"op": "pause", "tier": "disk"})
    ck = peer.expect("checkpointed")
    assert ck["step"] == p2["step"] and ck["bytes"] > 0 and ck["path"].startswith(str(ckpt))
    rc, _, err = finish(proc)
    assert rc == REQUEUE_EXIT_CODE, err

    # run 2: restarts from that checkpoint, pauses straight to disk -> exit 75
    proc = start_train(out, DEMO_STEPS, STEP_TIME, env, gate)
    hello = peer.expect("hello")
    assert hello["restored_step"] == ck["step"]
    peer.send({"op": "pause", "tier": "disk"})
    ck2 = peer.expect("checkpointed")
    assert ck2["step"] > ck["step"]
    rc, _, err = finish(proc)
    assert rc == REQUEUE_EXIT_CODE, err
    assert "restored checkpoint" in err

    # run 3: restarts, one more ram pause, then runs to the end
    proc = start_train(out, DEMO_STEPS, STEP_TIME, env, gate)
    assert peer.expect("hello")["restored_step"] == ck2["step"]
    _pause_ram_and_resume(peer)
    gate.touch()
    rc, _, err = finish(proc)
    assert rc == 0, err

    result = read_result(out)
    assert result["start_step"] == ck2["step"] + 1
    assert result["sha256"] == baseline["sha256"]
    assert result["loss_sum"] == baseline["loss_sum"]  # job.state came back too


def test_job_survives_absent_socket(tmp_path, baseline):
    out = tmp_path / "result.json"
    env = job_env(None, None, control="@gpuswap-rt-test-nobody-listens-here")
    rc, _, err = finish(start_train(out, DEMO_STEPS, 0.0, env))
    assert rc == 0, err
    assert err.count("unavailable") == 1  # one line, not one per retry
    assert read_result(out)["sha256"] == baseline["sha256"]


def test_job_reconnects_after_supervisor_drops(peer, tmp_path, baseline):
    out, gate = tmp_path / "result.json", tmp_path / "go"
    proc = start_train(out, DEMO_STEPS, STEP_TIME, job_env(peer, tmp_path / "ckpt"), gate)
    peer.expect("hello")
    peer.drop()
    assert peer.expect("hello")["pid"] == proc.pid  # it came back by itself
    _pause_ram_and_resume(peer)
    gate.touch()
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert "closed; training continues" in err
    assert read_result(out)["sha256"] == baseline["sha256"]


def test_failed_disk_pause_reports_error_and_trains_on(peer, tmp_path, baseline):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should go")
    out, gate = tmp_path / "result.json", tmp_path / "go"
    proc = start_train(out, DEMO_STEPS, STEP_TIME, job_env(peer, blocker / "ckpt"), gate)
    peer.expect("hello")
    peer.send({"op": "pause", "tier": "disk"})
    err_msg = peer.expect("error")
    assert "disk checkpoint failed" in err_msg["message"]
    _pause_ram_and_resume(peer)  # still alive and still pausable
    gate.touch()
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert read_result(out)["sha256"] == baseline["sha256"]
