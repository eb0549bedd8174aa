"""Gandiva's round-robin time slices and the SRTF oracle."""
from dataclasses import replace

from gpuswap.policy import Phase, PolicyConfig, decide
from policy_helpers import gpus, job, kinds, snap

CFG = PolicyConfig(gandiva_quantum_s=600)


def test_gandiva_slices_after_a_quantum_and_serves_the_longest_waiting():
    running = job("r", Phase.RUNNING, assigned=(0,), since=0)
    a = job("a", submit=10, since=10)
    b = job("b", submit=5, since=20)          # submitted earlier, but waiting since later
    assert decide(snap(599, gpus(1), [running, a, b], config=CFG), "gandiva") == []
    out = decide(snap(600, gpus(1), [running, a, b], config=CFG), "gandiva")
    assert kinds(out) == [("Pause", "r")] and "time slice" in out[0].reason
    paused = replace(running, phase=Phase.PAUSED, assigned=(), phase_since=601, parked="ram", node="n0")
    assert kinds(decide(snap(602, gpus(1), [paused, a, b], config=CFG), "gandiva")) == [("Start", "a")]


def test_gandiva_does_not_slice_without_oversubscription():
    running = job("r", Phase.RUNNING, assigned=(0,), since=0)
    assert decide(snap(5000, gpus(2), [running], config=CFG), "gandiva") == []


def test_srtf_oracle_preempts_for_shorter_remaining_time():
    long = job("long", Phase.RUNNING, assigned=(0,), since=0, remaining_s=5000)
    short = job("short", since=100, remaining_s=50)
    out = decide(snap(100, gpus(1), [long, short]), "srtf-oracle")
    assert kinds(out) == [("Pause", "long")] and "shorter remaining" in out[0].reason
    longer = replace(short, remaining_s=9000)
    assert decide(snap(100, gpus(1), [long, longer]), "srtf-oracle") == []
