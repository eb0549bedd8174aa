"""What the daemon, the per-job supervisor and the runtime in the job say to each other, in one
place: the shared vocabulary under `node/` and `runtime/`, importing neither.

- `env.py`: every environment variable gpuswap reads or sets, and `JobEnv`, the variables the
  daemon gives each job and its runtime reads back.
- `rundir.py`: the files of a launch's run directory (`jobs/ID/run-GEN/`): `spec.json` and
  `desired.json` (daemon -> supervisor), `spawned.json` (the daemon's mark), `status.json`
  (supervisor -> daemon, read back through `status.py`).
- `channel.py`: the control socket's framing (one JSON object per line) and addresses.
- `records.py`: every message on the channel as a typed record, in both directions, with its
  encoding; `bounds.py`: the bound of each field a job sends.
- `messages.py`: the gate, `parse`: a line from a job -> its record, every field checked against
  its bound: the one gate for job-supplied values (its docstring says why).
- `status.py`: `status.json`, as the supervisor writes it (`SupervisorStatus`) and as the daemon
  reads it back (`SupervisorReport`: the runtime facts, `RuntimeFacts`, the exit, the processes to
  kill), every field validated again (an older supervisor may have written it).

`env.py`, `channel.py`, `bounds.py`, `records.py` and `rundir.py` import nothing heavy (the
runtime imports them at `attach`); `messages.py` and `status.py` use pydantic and are imported by the supervisor and the
daemon, and by the runtime only where it coordinates ranks itself (runtime/slurmcoord.py).
"""
