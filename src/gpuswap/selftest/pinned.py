"""A plain pinned copy of N bytes between the GPU (the first visible one) and host memory, timed:
what a RAM park or resume of N bytes would take if it were copies and nothing else.

    CUDA_VISIBLE_DEVICES=GPU-... python -m gpuswap.selftest.pinned NBYTES [REPEATS]

Prints one JSON line: {"alloc_s", "d2h_s", "h2d_s"} (copies: best of REPEATS; allocation and
pinning of the host buffers, once). The host side is pinned buffers of 256 MiB (torch's pinned
allocator rounds each buffer up to a power of two: one buffer of 4.01 GiB would pin 8 GiB), the
device side one buffer; the copies are queued together and synchronized once, as a park's are.
Run in its own process by the selftest, so the selftest itself never holds a CUDA context.
"""
from __future__ import annotations

import json
import sys
import time

CHUNK = 256 * 2**20


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
    spans = [(a, min(a + CHUNK, nbytes)) for a in range(0, nbytes, CHUNK)]
    t0 = time.perf_counter()
    host = [torch.empty(b - a, dtype=torch.uint8, pin_memory=True) for a, b in spans]
    for h in host:
        h.fill_(0)                # touched, as the runtime's buffers are once written
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

    def d2h() -> None:
        for h, (a, b) in zip(host, spans):
            h.copy_(dev[a:b], non_blocking=True)

    def h2d() -> None:
        for h, (a, b) in zip(host, spans):
            dev[a:b].copy_(h, non_blocking=True)

    out = {"alloc_s": alloc, "d2h_s": best(d2h), "h2d_s": best(h2d)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
