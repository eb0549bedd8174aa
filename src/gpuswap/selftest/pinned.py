"""A plain pinned copy of N bytes between the GPU (the first visible one) and host memory, timed:
what a RAM park or resume of N bytes would take if it were one copy and nothing else.

    CUDA_VISIBLE_DEVICES=GPU-... python -m gpuswap.selftest.pinned NBYTES [REPEATS]

Prints one JSON line: {"alloc_s", "d2h_s", "h2d_s"} (copies: best of REPEATS; allocation and
pinning of the host buffer, once). Run in its own process by the selftest, so the selftest itself
never holds a CUDA context on the GPU it tests.
"""
from __future__ import annotations

import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    nbytes, repeats = int(args[0]), int(args[1]) if len(args) > 1 else 3
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device is visible to torch", file=sys.stderr)
        return 1
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.fill_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(0)                 # touched, as the runtime's buffers are once written
    alloc = time.perf_counter() - t0

    def best(copy) -> float:   # type: ignore[no-untyped-def]
        b = float("inf")
        for _ in range(max(1, repeats)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            b = min(b, time.perf_counter() - t)
        return b

    d2h = best(lambda: host.copy_(dev, non_blocking=True))
    h2d = best(lambda: dev.copy_(host, non_blocking=True))
    print(json.dumps({"alloc_s": alloc, "d2h_s": d2h, "h2d_s": h2d}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
