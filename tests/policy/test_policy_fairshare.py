"""Decayed usage: the half-life arithmetic both the daemon and the simulator use."""
import pytest

from gpuswap.policy.fairshare import decay_usage


def test_half_life_halves_usage():
    assert decay_usage({"a": 100.0}, 3600, {}, 3600) == pytest.approx({"a": 50.0})


def test_new_service_is_added_and_input_is_not_mutated():
    before = {"a": 10.0}
    after = decay_usage(before, 0.0, {"a": 5.0, "b": 7.0}, 3600)
    assert after == pytest.approx({"a": 15.0, "b": 7.0}) and before == {"a": 10.0}


def test_splitting_the_interval_gives_nearly_the_same_usage():
    one = decay_usage({"a": 0.0}, 3600, {"a": 3600.0}, 7200)
    many = {"a": 0.0}
    for _ in range(60):
        many = decay_usage(many, 60, {"a": 60.0}, 7200)
    assert many["a"] == pytest.approx(one["a"], rel=1e-3)


def test_time_going_backwards_is_refused():
    with pytest.raises(ValueError):
        decay_usage({}, -1, {}, 10)
