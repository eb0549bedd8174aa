"""`gpuswap` command line. Exit codes (gpuswap/exitcodes.py, listed by `gpuswap --help`): 0 ok,
1 failure, 64 usage error, 69 daemon unavailable, 124 `wait` timed out; `wait` otherwise exits
with the job's own exit code."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Callable, Optional

from gpuswap.api.client import Client, ClientError, body_of
from gpuswap.cli.argtypes import seconds
from gpuswap.cli.helptext import ENVIRONMENT, EXIT_CODES, JOB_ENVIRONMENT, HelpFormatter, VersionAction
from gpuswap.exitcodes import EX_FAILURE, EX_INTERRUPTED, EX_TIMEOUT, EX_UNAVAILABLE, EX_USAGE
from gpuswap.jobs import parse_size, parse_time_limit
from gpuswap.printable import printable

LS_DEFAULT = 100


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", HelpFormatter)   # every verb's options show their defaults
        super().__init__(*args, **kw)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        # argparse leaves a verb's unknown options for the top parser to report as
        # "gpuswap: unrecognized arguments"; report them here, under the verb that was given.
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):    # '²'.isdigit() is True, and int() refuses it
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def _job_id(text: str) -> int:
    """A job id: a positive integer (ids start at 1)."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1 or int(text) > 2**62:
        raise argparse.ArgumentTypeError(f"job id must be a positive integer, not {text!r}")
    return int(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _time(text: str) -> float:
    try:
        return parse_time_limit(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gib(text: str) -> float:
    """A positive, finite number of GiB (fractions allowed: 0.5)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0 or value > 2**20:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of GiB > 0")
    return value


def build_parser(verb: Optional[str] = None) -> Parser:
    """The whole command line; or, where `verb` (the call's first argument) is a verb, only the
    parsers of the module that defines it: the other verbs' modules (the server's settings and the
    policy, the simulator, the runtime, rich) were most of the CPU time of a `gpuswap ls`. Nothing
    else changes: a verb's parser is the same either way (tests/cli/test_cli_verbs.py), and a
    call that names no verb (`--help`, a typo) gets the whole command line to report against."""
    p = Parser(prog="gpuswap", description="Share GPUs: pause jobs at a safe point, park their memory, resume exactly.",
               epilog=f"{EXIT_CODES}\n\n{ENVIRONMENT}\n\n`gpuswap VERB --help` says what each verb takes.")
    p.add_argument("--version", action=VersionAction, help="print gpuswap's version and where it runs from, and exit")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    chosen = [add for verbs, add in VERB_MODULES if verb in verbs] or [add for _, add in VERB_MODULES]
    for add in chosen:
        add(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"   # "required: {server,submit,...}", not "verb"
    return p


def _add_server(sub: Any) -> None:
    from gpuswap.cli import server      # its flags are made from the settings object (node/settings.py)
    server.register(sub)


def _add_own(sub: Any) -> None:
    json_flag: dict[str, Any] = dict(action="store_true", help="print the record(s) as JSON")
    s = sub.add_parser("submit", help="queue a job: gpuswap submit [options] -- CMD ...",
                       description="Queue a job. It runs as you, in your working directory and with your "
                                   "environment, when the policy gives it GPUs.", epilog=JOB_ENVIRONMENT)
    s.add_argument("--name", help="a name to show in listings (default: the command's name)")
    s.add_argument("--priority", default="normal", choices=("urgent", "high", "normal", "low"),
                   help="its class: a higher class may pause lower ones to run (docs/policies.md)")
    s.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs the job needs, all at once")
    s.add_argument("--mem", type=_size, metavar="SIZE", help="GPU memory per GPU the job will use, e.g. 20GiB")
    s.add_argument("--no-preempt", action="store_true", help="never pause this job for another")
    s.add_argument("--time", type=_time, metavar="TIME",
                   help="how long it will run, as Slurm's --time: minutes, H:MM:SS, D-HH, or 4h, 90m, 1d. "
                        "Only an estimate: the policy serves jobs near their end first; nothing is "
                        "stopped when it is over (without it, the estimate comes from your earlier "
                        "runs of the same --name)")
    s.add_argument("--pause-mode", choices=("auto", "cooperative", "transparent"), default="auto",
                   help="how to park it: its gpuswap runtime (cooperative), the CUDA driver's checkpoint "
                        "API (transparent), or auto: cooperative if it attached a runtime, else transparent "
                        "where the driver supports it (default auto)")
    s.add_argument("--json", **json_flag)
    s.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    s.set_defaults(func=cmd_submit)

    s = sub.add_parser("ls", help="list your jobs")
    s.add_argument("--all-users", "-a", action="store_true", help="every user's jobs (admins)")
    s.add_argument("--limit", "-n", type=_count, default=LS_DEFAULT, metavar="N",
                   help=f"the newest N jobs (default {LS_DEFAULT}; 0: every job, fetched a page at a time)")
    s.add_argument("--json", **json_flag)
    s.set_defaults(func=cmd_ls)

    id_help = "the job's id (`gpuswap ls` shows it)"
    s = sub.add_parser("show", help="one job in detail, with its events")
    s.add_argument("id", type=_job_id, help=id_help)
    s.add_argument("--json", **json_flag)
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("logs", help="a job's output")
    s.add_argument("id", type=_job_id, help=id_help)
    s.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    s.set_defaults(func=cmd_logs)

    s = sub.add_parser("wait", help="wait for a job to end; exit with its exit code")
    s.add_argument("id", type=_job_id, help=id_help)
    s.add_argument("--timeout", type=seconds, metavar="S", help="give up after S seconds (exit 124)")
    s.add_argument("--json", **json_flag)
    s.set_defaults(func=cmd_wait)

    for verb, helptext in (("cancel", "stop a job"), ("resume", "let a paused job run again")):
        s = sub.add_parser(verb, help=helptext)
        s.add_argument("id", type=_job_id, help=id_help)
        s.add_argument("--json", **json_flag)
        s.set_defaults(func=cmd_action, action=verb)

    s = sub.add_parser("pause", help="park one of your running jobs until `gpuswap resume`")
    s.add_argument("id", type=_job_id, help=id_help)
    s.add_argument("--to", choices=("ram", "disk"), default="ram",
                   help="where its GPU memory goes: host RAM (fast to resume) or disk (frees RAM too)")
    s.add_argument("--json", **json_flag)
    s.set_defaults(func=cmd_action, action="pause")

    s = sub.add_parser("gpus", help="the node's GPUs and who holds them")
    s.add_argument("--json", **json_flag)
    s.set_defaults(func=cmd_gpus)

    s = sub.add_parser("demo", help="an urgent job takes a busy GPU; the long job resumes exactly")
    s.add_argument("--keep", action="store_true",
                   help="keep the demo's state directory (made inside $GPUSWAP_HOME when set, else in /tmp)")
    s.add_argument("--steps", type=int, default=400, metavar="N",
                   help="training steps of the long job: it must outlast its protection after start "
                        "(--min-runtime) for the urgent job to pause it, so too few are refused")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("selftest", help="prove on this machine's GPUs, under a private daemon, that jobs park "
                                        "and resume exactly (exit 0 only if every check holds)")
    s.add_argument("--gpu", type=_count, action="append", metavar="N",
                   help="test GPU N, as `gpuswap gpus` numbers them (repeatable; default: every GPU)")
    s.add_argument("--size", type=_gib, metavar="GiB",
                   help="GiB of state each bundled job holds (default 4; 1/16 on simulated GPUs)")
    s.add_argument("--simulate", action="store_true",
                   help="use simulated GPUs even where there are real ones: nothing real is measured")
    s.add_argument("--only", action="append", choices=("ram", "disk", "transparent"),
                   help="run only this scenario (repeatable; default: all three)")
    s.add_argument("--keep", action="store_true",
                   help="keep the private daemon's directory (it is kept anyway when a check fails)")
    s.add_argument("--json", action="store_true", help="print one JSON document with every figure and check")
    s.set_defaults(func=cmd_selftest)


def _add_remote(sub: Any) -> None:
    from gpuswap.cli import remote      # issue 6: tokens, dashboard URL
    remote.register(sub, lambda: _client(), _out)


def _add_top(sub: Any) -> None:
    from gpuswap.cli import top         # issue 6: live terminal view
    top.register(sub, lambda: _client())


def _add_slurm_wrap(sub: Any) -> None:
    from gpuswap.cli import slurm_wrap  # issue 5: Slurm signal forwarding for any command
    slurm_wrap.register(sub)


def _add_sim(sub: Any) -> None:
    from gpuswap.sim import cli as sim_cli   # imported plainly: a broken import must fail, not hide a verb
    sim_cli.register(sub)


def _add_completion(sub: Any) -> None:
    from gpuswap.cli import completion  # issue 14: shell completion
    completion.register(sub, build_parser)


def _add_service(sub: Any) -> None:
    from gpuswap.cli import service     # issue 14: the systemd unit
    service.register(sub)


# Each module that adds verbs, with the verbs it adds, in `gpuswap --help`'s order.
VERB_MODULES: tuple[tuple[frozenset[str], Callable[[Any], None]], ...] = (
    (frozenset({"server"}), _add_server),
    (frozenset({"submit", "ls", "show", "logs", "wait", "cancel", "resume", "pause", "gpus", "demo", "selftest"}),
     _add_own),
    (frozenset({"token", "dashboard-url"}), _add_remote),
    (frozenset({"top"}), _add_top),
    (frozenset({"slurm-wrap"}), _add_slurm_wrap),
    (frozenset({"sim"}), _add_sim),
    (frozenset({"completion"}), _add_completion),
    (frozenset({"service"}), _add_service),
)


# -- verbs ---------------------------------------------------------------------------------------
def cmd_submit(a: argparse.Namespace) -> int:
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        raise UsageError("gpuswap submit: no command given; write: gpuswap submit [options] -- CMD ARGS")
    if not command[0].strip():
        raise UsageError(f"gpuswap submit: the command name is empty ({command[0]!r}); "
                         "write: gpuswap submit [options] -- CMD ARGS")
    if a.gpus < 1:
        raise UsageError("gpuswap submit: --gpus must be at least 1")
    try:
        cwd = os.getcwd()
    except FileNotFoundError:   # removed under the shell: nothing to run the job in
        raise UsageError("gpuswap submit: the working directory no longer exists; cd to one that does") from None
    except OSError as e:
        raise UsageError(f"gpuswap submit: cannot tell the working directory: {e.strerror}") from None
    body = {"argv": command, "cwd": cwd, "env": dict(os.environ), "name": a.name,
            "priority": a.priority, "gpus": a.gpus, "mem": a.mem, "preemptible": not a.no_preempt,
            "pause_mode": a.pause_mode, "time_limit_s": a.time}
    rec = _client().post("/v1/jobs", body)
    _out(a, rec, lambda r: print(printable(f"submitted job {r['id']} ({r['name']})")))
    return 0


def cmd_ls(a: argparse.Namespace) -> int:
    """The newest --limit jobs, or every job by following the API's pages (oldest first)."""
    client, params = _client(), {"all": "true"} if a.all_users else {}
    if a.limit:
        r = client.request("GET", "/v1/jobs", params={**params, "limit": min(a.limit, 1000)})
        jobs = body_of(r)
        while len(jobs) < a.limit and "X-Next-Before" in r.headers:
            r = client.request("GET", "/v1/jobs", params={**params, "limit": min(a.limit - len(jobs), 1000),
                                                           "before": r.headers["X-Next-Before"]})
            jobs = body_of(r) + jobs
        total = int(r.headers.get("X-Total-Count", len(jobs)))
        if total > len(jobs) and not a.json:
            print(f"(the newest {len(jobs)} of {total} jobs; `gpuswap ls --limit 0` lists them all)",
                  file=sys.stderr)
    else:
        jobs, after = [], 0
        while after is not None:
            r = client.request("GET", "/v1/jobs", params={**params, "after": after})
            jobs += body_of(r)
            after = r.headers.get("X-Next-After")
    _out(a, jobs, lambda r: _render().jobs_table(r))
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    _out(a, _client().get(f"/v1/jobs/{a.id}"), lambda r: _render().job_detail(r))
    return 0


def cmd_logs(a: argparse.Namespace) -> int:
    client, offset = _client(), 0
    out = sys.stdout.buffer
    while True:
        r = client.request("GET", f"/v1/jobs/{a.id}/log", params={"offset": offset})
        out.write(r.content)
        out.flush()
        offset = int(r.headers["X-Next-Offset"])
        if not a.follow or (not r.content and r.headers["X-Job-State"] in ("COMPLETED", "FAILED", "CANCELLED")):
            return 0
        if not r.content:
            time.sleep(0.5)


# How long `wait` keeps asking a daemon that went away (a restart: `systemctl restart`, a crash and
# its unit's Restart=) before it says so with 69. The job's state is kept across a restart, and
# asking for it is safe to repeat: a script waiting on a job must not fail because the daemon did.
WAIT_REDIAL_S = 120.0


def cmd_wait(a: argparse.Namespace) -> int:
    client = _client()
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    gone_since: Optional[float] = None
    while True:
        left = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            job = client.get(f"/v1/jobs/{a.id}/wait", params={"timeout": min(30.0, left)})
        except ClientError as e:
            now = time.monotonic()
            if e.exit_code != EX_UNAVAILABLE or (gone_since is not None and now - gone_since > WAIT_REDIAL_S):
                raise
            if gone_since is None:
                gone_since = now
                print(printable(f"gpuswap wait: {e}; waiting up to {WAIT_REDIAL_S:g} s for it to come back"),
                      file=sys.stderr)
            if deadline is not None and now >= deadline:
                raise
            time.sleep(1.0)
            continue
        gone_since = None
        if job["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
            _out(a, job, lambda j: None)
            if job["exit_code"] is not None:
                return int(job["exit_code"])
            if job["state"] == "COMPLETED":
                return 0
            # No exit code of its own (it never started, or was cancelled before it did): say why,
            # or a script sees a bare 1.
            print(printable(f"gpuswap wait: job {a.id} {job['state']} with no exit code: {job.get('reason') or '-'}"),
                  file=sys.stderr)
            return EX_FAILURE
        if deadline is not None and time.monotonic() >= deadline:
            print(f"gpuswap wait: job {a.id} is still {job['state']} after {a.timeout:g} s", file=sys.stderr)
            return EX_TIMEOUT


def cmd_action(a: argparse.Namespace) -> int:
    body = {"to": a.to} if a.action == "pause" else None
    job = _client().post(f"/v1/jobs/{a.id}/{a.action}", body)
    if job.get("nothing_done"):     # already as asked: exit 0 (the state is what was wanted), but say so
        print(printable(f"gpuswap {a.action}: {job['nothing_done']}"), file=sys.stderr)
    _out(a, job, lambda j: None if j.get("nothing_done") else
         print(printable(f"job {j['id']}: {_render().state_text(j)} — {j['reason']}")))
    return 0


def cmd_gpus(a: argparse.Namespace) -> int:
    _out(a, _client().get("/v1/gpus"), lambda r: _render().gpus_table(r))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from gpuswap.demo.story import run_demo, steps_problem

    problem = steps_problem(a.steps)     # before the reference run, not after the whole demo
    if problem:
        raise UsageError(f"gpuswap demo: {problem}")
    try:
        return run_demo(keep=a.keep, steps=a.steps)
    except BrokenPipeError:     # its reader went away mid-story: the story was not told, and is no success
        _reader_gone()
        return EX_FAILURE


def cmd_selftest(a: argparse.Namespace) -> int:
    from gpuswap.cli.render import console, plain
    from gpuswap.selftest import report, runner
    from gpuswap.terminal import PipeConsole

    err, t0 = PipeConsole(stderr=True, highlight=False), time.monotonic()
    opts = runner.Options(gpus=a.gpu, size_gib=a.size, simulate=a.simulate, only=a.only, keep=a.keep,
                          progress=lambda line: err.print(plain(f"{time.monotonic() - t0:6.1f}s  {line}", "dim"),
                                                           soft_wrap=True))
    try:
        found = runner.run(opts)
    except runner.UsageProblem as e:
        raise UsageError(f"gpuswap selftest: {e}") from None
    try:
        if a.json:
            if found.simulated:
                report.banner(err)
            print_json(found.to_json())
        else:
            report.render(found, console)
    except BrokenPipeError:     # the report's reader went away: the checks' verdict still stands
        _reader_gone()
    return 0 if found.ok else EX_FAILURE


# -- plumbing ------------------------------------------------------------------------------------
def _client() -> Client:
    return Client()


def _render() -> Any:
    """cli/render.py (rich tables), imported only for output to a person: `--json` needs no rich."""
    from gpuswap.cli import render

    return render


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True))


def _out(a: argparse.Namespace, record: Any, human: Callable[[Any], None]) -> None:
    if getattr(a, "json", False):
        print_json(record)
    else:
        human(record)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        return int(args.func(args) or 0)
    except UsageError as e:
        print(printable(str(e)), file=sys.stderr)
        return EX_USAGE
    except ClientError as e:
        print(printable(f"gpuswap: {e}"), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EX_INTERRUPTED
    except BrokenPipeError:     # the reader went away (`gpuswap ls | head -1`): not a failure
        _reader_gone()
        return 0


def _reader_gone() -> None:
    """What is still buffered for stdout goes nowhere: the interpreter's flush at exit would fail
    on the closed pipe (exit 120)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
