"""`gpuswap selftest`: proves, on this machine's GPUs and under a private daemon, that a job is
parked in RAM, on disk and (where the driver allows) transparently, and resumes bitwise exact,
with NVML, host RAM and timing figures beside a plain pinned copy (docs/selftest.md).

  runner.py   the story: the scenarios, GPU by GPU
  harness.py  the private daemon, the jobs on it (held, placed), the references outside it
  jobs.py     the bundled jobs' commands and sizes (coop_job.py, plain_job.py)
  measure.py  NVML per process tree, RSS, the daemon's move timings, the plain copy (pinned.py)
  checks.py   the thresholds and the checks
  results.py  what a run found (the JSON document)
  report.py   the terminal report
"""
