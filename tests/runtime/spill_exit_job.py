"""A job that checks, while it unwinds from a spill's exit (SystemExit 75), that its tensors are
whole, as Lightning's teardown (the optimizer state moved to the CPU) and the job's own cleanup
code expect. Writes OUT: the digest of its state before the pause and while leaving.
SPILL_EXIT_KEEP_FREED=1: a mutation, the spill leaves its freed tensors freed (as before
parking.leave_on_host); the teardown's `.to("cpu")` must then fail as it did on an H100."""
import hashlib
import json
import os
import sys

import torch

import gpuswap


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        # a copy, as `.to("cpu")` of a GPU tensor is: `.numpy()` of a simulated device tensor itself
        # would make its storage non-resizable for good (parked then by a placeholder, not freed)
        h.update(t.detach().to("cpu").clone().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


out = sys.argv[1]
if os.environ.get("SPILL_EXIT_KEEP_FREED") == "1":
    from gpuswap.runtime import parking

    parking.leave_on_host = lambda park, tensors: 0
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 64)).sum().backward()
opt.step()
view = model.weight.detach()[:8]                     # a view of a parked storage


def state():
    return list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if v.dim()]


before = digest(state())
job = gpuswap.attach(model=model, optimizer=opt, view=view)
step = 0
try:
    while True:
        job.safepoint(step)                   # parked in RAM here, then spilled: exit 75
        step += 1
finally:
    for t in state() + [view]:
        t.to("cpu")                           # what Lightning's teardown does (_optimizers_to_device)
    whole = all(t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()
                for t in state() + [view])
    leaving = digest(state()) if whole else None
    if whole:
        view.fill_(7.0)                       # the view still shares the weight's bytes
    with open(out, "w") as f:
        json.dump({"before": before, "leaving": leaving, "whole": whole,
                   "shared": whole and bool((model.weight[:8] == 7.0).all())}, f)
