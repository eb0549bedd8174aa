"""What the daemon, the per-job supervisor and the runtime in the job say to each other, in one
place: the shared vocabulary under `node/` and `runtime/`, importing neither.

- `env.py`: every environment variable gpuswap reads or sets, and `JobEnv`, the variables the
  daemon gives each job and its runtime reads back.
- `rundir.py`: the files of a launch's run directory (`jobs/ID/run-GEN/`): `spec.json` and
  `desired.json` (daemon -> supervisor), `spawned.json` (the daemon's mark), `status.json`
  (supervisor -> daemon, read back through `facts.py`).
- `channel.py`: the control socket's framing (one JSON object per line) and addresses.
- `messages.py`: the control messages a job may send, typed and bounded: the one gate for
  job-supplied values (its docstring says why).
- `facts.py`: `status.json` as the daemon reads it back: the runtime facts (`RuntimeFacts`), the
  exit, the processes to kill; every field validated again (an older supervisor may have written it).

`env.py` and `channel.py` are cheap to import (the runtime imports them at `attach`); the others
use pydantic and are imported by the supervisor and the daemon, and by the runtime only where it
coordinates ranks itself (runtime/slurmcoord.py).
"""
