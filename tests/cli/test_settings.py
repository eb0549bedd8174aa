"""The daemon's settings (node/settings.py): one object, flags > config file > defaults, every value
checked once by its setting's reader, and every problem one line with exit 64 that names the file
and the key, before the daemon touches its home."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

from gpuswap.node import settings
from gpuswap.protocol import env as envvars
from gpuswap.node.settings import ServerSettings, SettingsError, load

SYSTEM_HOME = Path("/var/lib/gpuswap")


def server(*args: str, home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != envvars.CONFIG} | {"GPUSWAP_HOME": str(home)} | (env or {})
    return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def effective(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return tomllib.loads(result.stdout)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o644)
    return path


# -- one object, one set of defaults -----------------------------------------------------------
def test_defaults_are_the_policy_and_daemon_defaults_and_pass_their_own_readers():
    from gpuswap.policy.model import PolicyConfig

    s = ServerSettings()
    assert (s.min_runtime_s, s.max_switch_fraction) == (PolicyConfig().min_runtime_s, PolicyConfig().max_switch_fraction)
    assert s.policy == "gpuswap" and s.retention_s == 30 * 86400 and s.calibrate is True and s.ram_budget is None
    for name, spec, default in settings.specs():
        assert spec.help and spec.key
        if default is not None:
            # a default read back through its TOML form is itself: defaults obey their own rules
            literal = spec.show(default)
            assert spec.read(tomllib.loads(f"v = {literal}")["v"], spec.key) == default, name


def test_no_other_module_declares_the_servers_defaults():
    """The controller, launcher and authorizer take their values from the settings: a default left
    there would be a second declaration that could drift."""
    import dataclasses
    import inspect

    from gpuswap.api.auth import Authorizer
    from gpuswap.node.controller import ControllerConfig
    from gpuswap.node.launcher import Launcher

    fields = {f.name: f for f in dataclasses.fields(ControllerConfig)}
    for name in ("policy", "pause_timeout_s", "attach_grace_s", "no_runtime", "ram_budget"):
        assert fields[name].default is dataclasses.MISSING, name
    assert inspect.signature(Launcher).parameters["pause_timeout_s"].default is inspect.Parameter.empty
    assert inspect.signature(Authorizer).parameters["admin_group"].default is inspect.Parameter.empty


# -- precedence --------------------------------------------------------------------------------
def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    conf = write(tmp_path / "g.toml", 'min-runtime = 5\npolicy = "fifo"\nretention = "12h"\ncalibrate = false\n')
    got = effective(server("--config", str(conf), "--min-runtime", "7", "--print-config", home=tmp_path / "h"))
    assert got["min-runtime"] == 7.0                     # flag over file
    assert got["policy"] == "fifo" and got["retention"] == "12h" and got["calibrate"] is False   # file over defaults
    assert got["pause-timeout"] == 60.0 and got["no-runtime"] == "wait"                            # defaults
    assert "listen" not in got                                                                     # not set
    got = effective(server("--config", str(conf), "--no-calibrate", "--print-config", home=tmp_path / "h"))
    assert got["calibrate"] is False and got["min-runtime"] == 5.0


def test_load_reads_each_source_with_the_same_reader():
    s = load({"min_runtime_s": "7", "calibrate": False}, {"min-runtime": 5, "policy": "las", "ram-budget": "1GiB"})
    assert (s.min_runtime_s, s.policy, s.ram_budget, s.calibrate) == (7.0, "las", 2**30, False)
    assert load({}, {"retention": "never"}).retention_s is None
    assert load({}, {"ram-budget": 4096, "simulate-gpus": 2}) == ServerSettings(ram_budget=4096, simulate_gpus="2")


def test_protection_settings_reach_the_policy_config_from_flags_and_file():
    """Cost-aware protection (docs/policies.md): --min-runtime is its floor, --protect-multiple and
    --protect-cap the rest; both sources, one reader, defaults the policy's own."""
    from gpuswap.policy.model import PolicyConfig
    s = load({}, {})
    assert (s.min_runtime_s, s.protect_multiple, s.protect_cap_s) == (
        PolicyConfig().min_runtime_s, PolicyConfig().protect_multiple, PolicyConfig().protect_cap_s)
    s = load({"protect_cap_s": "30"}, {"protect-multiple": 2, "protect-cap": 90, "min-runtime": 60})
    assert (s.min_runtime_s, s.protect_multiple, s.protect_cap_s) == (60.0, 2.0, 30.0)
    with pytest.raises(SettingsError, match=r"^--protect-multiple '-1' must be a finite number >= 0$"):
        load({"protect_multiple": "-1"}, {})


def test_the_printed_config_reads_back_as_the_same_settings(tmp_path):
    home = tmp_path / "h"
    flags = ("--simulate-gpus", "2x8GiB", "--ram-budget", "3GiB", "--listen", "127.0.0.1:0", "--retention", "90m",
             "--admin-group", 'we "quote" \\ odd', "--dcgm-job-mapping-dir", str(tmp_path / "dcgm"))
    first = server(*flags, "--print-config", home=home)
    conf = write(tmp_path / "round.toml", first.stdout)
    again = server("--config", str(conf), "--print-config", home=home)
    assert effective(again) == effective(first)


def test_default_file_is_per_state_directory(tmp_path):
    """/etc/gpuswap/gpuswap.toml for the machine-wide daemon only; any other daemon (a user's, a
    test's, selftest's private one) reads HOME/gpuswap.toml, never the machine's settings."""
    assert settings.config_file(None, {}, SYSTEM_HOME, SYSTEM_HOME) == (settings.SYSTEM_CONFIG, False)
    assert settings.config_file(None, {}, tmp_path, SYSTEM_HOME) == (tmp_path / "gpuswap.toml", False)
    assert settings.config_file(None, {"GPUSWAP_CONFIG": "/x.toml"}, tmp_path, SYSTEM_HOME) == (Path("/x.toml"), True)
    assert settings.config_file("/y.toml", {"GPUSWAP_CONFIG": "/x.toml"}, tmp_path, SYSTEM_HOME) == (Path("/y.toml"), True)
    home = tmp_path / "h"
    home.mkdir()
    write(home / "gpuswap.toml", "pause-timeout = 9\n")
    assert effective(server("--print-config", home=home))["pause-timeout"] == 9.0
    conf = write(tmp_path / "env.toml", "pause-timeout = 11\n")
    assert effective(server("--print-config", home=home, env={"GPUSWAP_CONFIG": str(conf)}))["pause-timeout"] == 11.0


def test_an_absent_default_file_is_no_error(tmp_path):
    got = effective(server("--print-config", home=tmp_path / "none"))
    assert got["policy"] == "gpuswap"


# -- errors: one line, exit 64, the file and the key named, the home untouched --------------------
BAD_FILES = [
    ("min_runtime = 5\n", "unknown key 'min_runtime'; did you mean 'min-runtime'?"),
    ("bogus = 1\n", "unknown key 'bogus'; the keys are: simulate-gpus"),
    ("[server]\npolicy = 'fifo'\n", "unknown key 'server'; settings are keys at the top of the file, not in a table"),
    ('min-runtime = "soon"\n', "min-runtime 'soon' is not a number"),
    ("min-runtime = -1\n", "min-runtime -1 must be a finite number >= 0"),
    ("min-runtime = nan\n", "min-runtime nan must be a finite number >= 0"),
    ("protect-cap = -5\n", "protect-cap -5 must be a finite number >= 0"),
    ('protect-multiple = "x"\n', "protect-multiple 'x' is not a number"),
    ("pause-timeout = true\n", "pause-timeout must be a number, not a boolean"),
    ('calibrate = "no"\n', "calibrate must be true or false, not a string"),
    ("policy = 3\n", "policy must be a string, not an integer"),
    ('policy = "bogus"\n', "policy 'bogus' is not a policy"),
    ('simulate-gpus = "2x0"\n', "simulate-gpus '2x0' gives its GPUs no memory"),
    ("simulate-gpus = 1979-05-27\n", "simulate-gpus must be a string, not a date"),
    ('listen = "nowhere"\n', "cannot read listen 'nowhere'"),
    ('ram-budget = "lots"\n', "ram-budget: cannot read size 'lots'"),
    ('retention = "soon"\n', "retention: cannot read 'soon' as a duration"),
    ('no-runtime = "kill"\n', "no-runtime 'kill' must be one of: wait, sigstop"),
    ("min-runtime = \n", "not valid TOML: "),
    # tomllib parses nesting recursively: deep enough, a RecursionError, not a TOMLDecodeError
    pytest.param("x = " + "[" * 5000 + "]" * 5000 + "\n", "not valid TOML: arrays or tables nested too deeply",
                 id="arrays nested 5000 deep"),
    pytest.param("x = " + "{a=" * 5000 + "1" + "}" * 5000 + "\n", "not valid TOML: arrays or tables nested too deeply",
                 id="inline tables nested 5000 deep"),
]


@pytest.mark.parametrize("text,says", BAD_FILES)
def test_a_bad_config_file_is_one_line_naming_file_and_key(tmp_path, text, says):
    conf = write(tmp_path / "gpuswap.toml", text)
    home = tmp_path / "h"
    r = server("--simulate-gpus", "1", "--config", str(conf), home=home)
    assert r.returncode == 64, (r.returncode, r.stderr)
    assert r.stderr == f"gpuswap server: {conf}: {r.stderr.split(': ', 2)[2]}" and r.stderr.count("\n") == 1, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not home.exists()


def test_a_named_file_must_exist_and_be_a_file(tmp_path):
    for args, env, says in ((["--config", str(tmp_path / "no.toml")], {}, f"{tmp_path / 'no.toml'}: no such config file"),
                            ([], {"GPUSWAP_CONFIG": str(tmp_path / "env.toml")}, f"{tmp_path / 'env.toml'}: no such config file"),
                            (["--config", str(tmp_path)], {}, "is a directory, not a config file"),
                            (["--config", "~no-such-user-gs/g.toml"], {}, "cannot expand '~no-such-user-gs'")):
        r = server("--simulate-gpus", "1", *args, home=tmp_path / "h", env=env)
        assert r.returncode == 64 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "h").exists()


def test_a_default_file_nested_too_deeply_is_one_line(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    conf = write(home / "gpuswap.toml", "x = " + "[" * 5000 + "]" * 5000 + "\n")
    r = server("--print-config", home=home)
    assert r.returncode == 64 and r.stderr == f"gpuswap server: {conf}: not valid TOML: arrays or tables nested too deeply\n", r.stderr


def test_a_config_file_that_is_not_a_regular_file_is_refused_not_waited_on(tmp_path):
    """A FIFO would block the open (and the read) until some writer came; a device may never end."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo, 0o600)
    home = tmp_path / "h"
    home.mkdir()
    os.mkfifo(home / "gpuswap.toml", 0o600)       # the default file, read only if it exists
    for args, path in ((["--config", str(fifo)], fifo), (["--config", "/dev/zero"], "/dev/zero"),
                       ([], home / "gpuswap.toml")):
        r = server("--simulate-gpus", "1", *args, "--print-config", home=home)
        assert r.returncode == 64, (r.returncode, r.stderr)
        assert r.stderr == f"gpuswap server: {path}: not a regular file (a FIFO, socket or device), not a config file\n"
    assert os.listdir(home) == ["gpuswap.toml"]


def test_a_dcgm_mapping_dir_that_cannot_be_a_directory_is_refused_at_start(tmp_path):
    """Accepted, it failed every write of the mapping, with a traceback in the log every 2 s."""
    a_file = write(tmp_path / "file", "")
    for where, more, says in (
            (a_file, (), f"--dcgm-job-mapping-dir '{a_file}' is not a directory"),
            (a_file, ("--print-config",), f"--dcgm-job-mapping-dir '{a_file}' is not a directory"),
            (a_file / "x", (), f"--dcgm-job-mapping-dir '{a_file / 'x'}': cannot make the directory: Not a directory"),
            ("x" * 300, (), f"--dcgm-job-mapping-dir '{'x' * 300}': cannot make the directory: File name too long"),
            ("~no-such-user-gs/x", ("--print-config",), "--dcgm-job-mapping-dir '~no-such-user-gs/x': cannot expand "
                                                        "'~no-such-user-gs': no such user's home directory")):
        r = server("--simulate-gpus", "1", "--no-calibrate", "--dcgm-job-mapping-dir", str(where), *more,
                   home=tmp_path / "h")
        assert r.returncode == 64 and r.stderr == f"gpuswap server: {says}\n", (r.returncode, r.stderr)
    conf = write(tmp_path / "g.toml", f"dcgm-job-mapping-dir = {str(a_file)!r}\n")
    r = server("--config", str(conf), "--print-config", home=tmp_path / "h")
    assert r.returncode == 64 and r.stderr == f"gpuswap server: {conf}: dcgm-job-mapping-dir {str(a_file)!r} is not a directory\n"
    assert not (tmp_path / "h").exists()


def test_a_file_others_may_write_is_refused(tmp_path):
    """Whoever may write the file chooses the admin group and the TCP listener."""
    conf = write(tmp_path / "g.toml", "pause-timeout = 9\n")
    conf.chmod(0o664)
    r = server("--print-config", "--config", str(conf), home=tmp_path / "h")
    assert r.returncode == 64 and "others may write it (mode 0664)" in r.stderr, r.stderr
    with pytest.raises(SettingsError, match="owned by uid"):
        settings._check_owner(conf, os.stat_result((0o100644, 0, 0, 1, os.geteuid() + 1, 0, 0, 0, 0, 0)))


def test_class_limits_reach_the_policy_from_flags_and_file(tmp_path):
    """Issue 15 item 5: the class budget, its half-life and the floor share, from a flag or the
    file, read back as TOML (no budget: `inf`), and refused with one line when out of range."""
    import math

    from gpuswap.policy.model import PolicyConfig

    d = ServerSettings()
    assert (d.class_budget_gpu_h, d.class_half_life_s, d.class_floor_share) == (
        PolicyConfig().class_budget_gpu_h, PolicyConfig().class_half_life_s, PolicyConfig().class_floor_share)
    s = load({"class_budget_gpu_h": "none", "class_floor_share": "0.5"}, {"class-half-life": 3600})
    assert (s.class_budget_gpu_h, s.class_floor_share, s.class_half_life_s) == (math.inf, 0.5, 3600.0)
    assert load({}, {"class-budget": 50}).class_budget_gpu_h == 50.0
    conf = write(tmp_path / "g.toml", "class-budget = 24.5\nclass-floor = 0\n")
    got = effective(server("--config", str(conf), "--class-budget", "none", "--print-config", home=tmp_path / "h"))
    assert (got["class-budget"], got["class-floor"]) == (math.inf, 0.0)
    again = effective(server("--config", str(write(tmp_path / "r.toml", "class-budget = inf\n")),
                             "--print-config", home=tmp_path / "h"))
    assert again["class-budget"] == math.inf
    for flags, says in ((("--class-floor", "1"), "--class-floor '1' must be a share of the GPUs below 1"),
                        (("--class-budget", "-3"), "--class-budget '-3' must be a number of GPU-hours >= 0"),
                        (("--class-budget", "lots"), "--class-budget 'lots' is not a number of GPU-hours"),
                        (("--class-half-life", "0"), "--class-half-life '0' must be > 0")):
        r = server(*flags, "--print-config", home=tmp_path / "h")
        assert r.returncode == 64 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_flag_errors_name_the_flag():
    with pytest.raises(SettingsError, match=r"^--min-runtime '-1' must be a finite number >= 0$"):
        load({"min_runtime_s": "-1"}, {})
    with pytest.raises(SettingsError, match=r"^cannot read --listen 'x'"):
        load({"listen": "x"}, {})
