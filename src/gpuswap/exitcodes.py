"""Every exit status `gpuswap` returns, in one place: the CLI, the daemon, `sim`, `slurm-wrap` and
the in-job runtime use these names, and `gpuswap --help` prints `DESCRIBED`.

The numbers follow sysexits.h where it has one (64 usage, 69 unavailable, 70 software, 75
temporary failure) and the shell's conventions otherwise (124 timeout as timeout(1), 126/127
cannot execute / not found, 128+N killed by signal N)."""
from __future__ import annotations

EX_OK = 0
EX_FAILURE = 1         # the daemon refused, or an operation failed
EX_USAGE = 64          # a bad argument, option or config file (sysexits EX_USAGE)
EX_UNAVAILABLE = 69    # no daemon to talk to (sysexits EX_UNAVAILABLE)
EX_SOFTWARE = 70       # an internal error (`gpuswap sim`; sysexits EX_SOFTWARE)
EX_TEMPFAIL = 75       # "requeue me": checkpointed to disk, start again later (sysexits EX_TEMPFAIL)
EX_TIMEOUT = 124       # `gpuswap wait --timeout` ran out, as timeout(1)
EX_NOEXEC = 126        # `slurm-wrap`: CMD exists but cannot be executed, as a shell says
EX_NOTFOUND = 127      # `slurm-wrap`: CMD not found, as a shell says
EX_INTERRUPTED = 130   # Ctrl-C: 128 + SIGINT

# (code, meaning) for `gpuswap --help`; a test checks every code above is described.
DESCRIBED: tuple[tuple[str, str], ...] = (
    (str(EX_OK), "success"),
    (str(EX_FAILURE), "failure: the daemon refused, or the operation failed"),
    (str(EX_USAGE), "usage error: a bad argument, option or config file"),
    (str(EX_UNAVAILABLE), "no daemon to talk to (none running, or GPUSWAP_URL unreachable)"),
    (str(EX_SOFTWARE), "`sim`: an internal error in the simulator"),
    (str(EX_TEMPFAIL), "`slurm-wrap`, and a job's runtime: checkpointed to disk, requeue the job"),
    (str(EX_TIMEOUT), "`wait --timeout` ran out"),
    (f"{EX_NOEXEC}, {EX_NOTFOUND}", "`slurm-wrap`: CMD cannot be executed, or is not found"),
    (str(EX_INTERRUPTED), "interrupted (Ctrl-C)"),
    ("other", "`wait`: the job's own exit code; `slurm-wrap`: CMD's (128+N when signal N killed it)"),
)
