"""The simulated GPU is as strict as a real one about tensors a RAM park freed (runtime/freedguard.py):
reading or copying one raises "CUDA error: invalid argument" (an H100's answer to `.to("cpu")` of
one), metadata and views pass, and after the restore nothing is left on the torch-function mode
stack, a user's own modes included. Never on a real GPU."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gpuswap.runtime import freedguard, parking

FREED = "CUDA error: invalid argument"


def _stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


class UserMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def parked():
    torch.manual_seed(0)
    t = torch.randn(4, 4)
    early_view = t[1:3]                      # made before the park: shares the freed storage
    ref = t.clone()
    park = parking.copy_to_host([t], simulated=True)
    parking.release(park, simulated=True)
    yield t, early_view, ref, park
    parking.drop_host(park)                  # the guard goes with the host copies
    assert not freedguard.current() or not freedguard.current().parks


@pytest.mark.parametrize("op", [
    lambda t: t.to("cpu"), lambda t: t.cpu(), lambda t: t.to(torch.float16), lambda t: t.sum(),
    lambda t: t.clone(), lambda t: torch.empty(4, 4).copy_(t), lambda t: t.copy_(torch.zeros(4, 4)),
    lambda t: t.zero_(), lambda t: torch._foreach_mul_([t], 2.0), lambda t: t + 1, lambda t: repr(t),
    lambda t: copy.deepcopy(t), lambda t: torch.nn.functional.linear(torch.ones(1, 4), t),
], ids=["to-cpu", "cpu", "to-half", "sum", "clone", "copy-from", "copy-into", "zero_", "foreach", "add",
        "repr", "deepcopy", "linear"])
def test_reading_or_writing_a_freed_tensor_raises_as_cuda_does(parked, op):
    t, _, _, _ = parked
    with pytest.raises(RuntimeError, match=FREED):
        op(t)


def test_metadata_and_views_pass(parked):
    t, early_view, _, _ = parked
    assert t.shape == (4, 4) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.numel() == 16 and t.stride() == (4, 1) and t.untyped_storage().nbytes() == 0
    assert isinstance(hash(t), int) and t.data_ptr() is not None
    assert t.view(-1).shape == (16,) and t.view(2, 8).shape == (2, 8) and t.reshape(16).shape == (16,)
    assert torch.zeros_like(t).sum() == 0 and t.new_zeros(2).shape == (2,)
    assert early_view.shape == (2, 4)
    with pytest.raises(RuntimeError, match=FREED):
        early_view.sum()                     # a view made before the park reads the freed storage
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
        t[1]                                 # torch's own bounds check (as_strided), the same on CUDA
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
        t.t()
    other = torch.randn(3)                   # not parked: untouched
    assert torch.equal(other.clone(), other)


def test_restore_makes_everything_work_and_leaves_the_mode_stack_as_it_was():
    t = torch.randn(8, 8)
    ref = t.clone()
    with torch.device("cpu"), UserMode() as mine:
        before = _stack()
        park = parking.copy_to_host([t], simulated=True)
        parking.release(park, simulated=True)
        during = _stack()
        assert len(during) == len(before) + 1 and during[-1] is mine   # below the user's own modes
        assert during[0] is freedguard.current()
        with pytest.raises(RuntimeError, match=FREED):
            t.sum()
        parking.restore(park, simulated=True)
        parking.drop_host(park)
        assert _stack() == before
        assert torch.equal(t, ref) and torch.equal(t.to("cpu"), ref) and torch.equal(t.clone(), ref)
    assert _stack() == []


def test_user_modes_exiting_while_parked_stay_balanced():
    """A spill's SystemExit unwinds through the job's `with` blocks while the guard is still on."""
    t = torch.randn(4)
    park = parking.copy_to_host([t], simulated=True)
    with torch.device("cpu"):
        with UserMode():
            parking.release(park, simulated=True)
        assert len(_stack()) == 2            # the user's mode popped itself, not the guard
    guard = _stack()
    assert len(guard) == 1 and guard[0] is freedguard.current()
    with pytest.raises(RuntimeError, match=FREED):
        t.to("cpu")
    parking.restore(park, simulated=True)
    parking.drop_host(park)
    assert _stack() == [] and t.to("cpu").shape == (4,)


def test_the_default_device_context_stays_at_the_bottom():
    """torch.set_default_device's DeviceContext must stay the bottom mode (its __exit__ checks)."""
    t = torch.randn(4)
    park = parking.copy_to_host([t], simulated=True)
    torch.set_default_device("cpu")
    try:
        parking.release(park, simulated=True)
        stack = _stack()
        assert isinstance(stack[0], torch.utils._device.DeviceContext) and stack[1] is freedguard.current()
        with pytest.raises(RuntimeError, match=FREED):
            t.sum()
    finally:
        torch.set_default_device(None)        # its __exit__, with the guard above it
    assert _stack() == [freedguard.current()]
    parking.restore(park, simulated=True)
    parking.drop_host(park)
    assert _stack() == []


def test_a_failed_restore_guards_again(monkeypatch):
    t = torch.randn(4)
    ref = t.clone()
    park = parking.copy_to_host([t], simulated=True)
    parking.release(park, simulated=True)

    def full(slots):
        raise RuntimeError("CUDA out of memory (test)")

    monkeypatch.setattr(parking, "_refill", full)
    with pytest.raises(RuntimeError, match="out of memory"):
        parking.restore(park, simulated=True)
    with pytest.raises(RuntimeError, match=FREED):
        t.sum()
    monkeypatch.undo()
    parking.restore(park, simulated=True)
    parking.drop_host(park)
    assert torch.equal(t, ref) and _stack() == []


def test_leave_on_host_makes_attached_tensors_whole_and_a_kept_view_still_fails():
    t = torch.randn(6)
    kept = t[:3]                              # held by the job, not attached
    ref = t.clone()
    park = parking.copy_to_host([t], simulated=True)
    parking.release(park, simulated=True)
    parking.leave_on_host(park, [t])
    assert torch.equal(t.to("cpu"), ref)      # whole, on the host
    with pytest.raises(RuntimeError, match=FREED):
        kept.to("cpu")                        # still on the freed storage, as on a GPU
    parking.drop_host(park)
    assert _stack() == []


def test_other_threads_have_no_guard():
    t = torch.randn(4)
    park = parking.copy_to_host([t], simulated=True)
    parking.release(park, simulated=True)
    seen = []
    th = threading.Thread(target=lambda: seen.append(torch._C._len_torch_function_stack()))
    th.start()
    th.join()
    assert seen == [0] and len(_stack()) == 1
    parking.restore(park, simulated=True)
    parking.drop_host(park)


def test_no_mode_on_a_real_gpu_path():
    t = torch.randn(4)
    park = parking.copy_to_host([t], simulated=True)     # CPU slots, freed by the real-GPU path
    parking.release(park, simulated=False)
    assert t.untyped_storage().nbytes() == 0
    assert not park.guarded and _stack() == []
    assert freedguard.current() is None or id(park) not in freedguard.current().parks
    assert t.to("cpu") is t                   # what the unguarded CPU stand-in does
    parking.restore(park, simulated=False)
    parking.drop_host(park)
