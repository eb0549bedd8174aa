"""`gpuswap sim` as a command: registration, exit codes, summary.json, plots."""
import argparse
import json

import pytest

from gpuswap.sim import cli


def parse(argv):
    parser = argparse.ArgumentParser(prog="gpuswap")
    sub = parser.add_subparsers()
    cli.register(sub)
    return parser.parse_args(["sim", *argv])


def test_register_sets_run():
    args = parse(["--trace", "x.csv"])
    assert args.func is cli.run and args.policy == "gpuswap"


@pytest.mark.parametrize("argv, message", [
    (["--trace", "/nonexistent.csv"], "cannot open trace"),
    (["--trace", "{bad}"], "lacks required column"),
    (["--trace", "{good}", "--policy", "nope"], "unknown policy nope"),
    (["--trace", "{good}", "--switch-cost", "free"], "unknown switch-cost"),
    (["--trace", "{good}", "--switch-cost", "fixed:nan"], "bad switch-cost"),
    (["--trace", "{good}", "--min-runtime", "-5"], "--min-runtime must be a number of seconds >= 0"),
    (["--trace", "{good}", "--min-runtime", "inf"], "--min-runtime must be"),
    (["--trace", "{good}", "--protect-multiple", "-1"], "--protect-multiple must be a number >= 0, got -1.0"),
    (["--trace", "{good}", "--protect-multiple", "nan"], "--protect-multiple must be"),
    (["--trace", "{good}", "--protect-cap", "-5"], "--protect-cap must be a number of seconds >= 0, got -5.0"),
    (["--trace", "{good}", "--protect-cap", "inf"], "--protect-cap must be"),
    (["--trace", "{good}", "--reserve-after", "-5"], "--reserve-after must be a number of seconds >= 0 or 'never'"),
    (["--trace", "{good}", "--reserve-after", "inf"], "--reserve-after must be"),
    (["--trace", "{good}", "--tick", "0"], "--tick must be a number of seconds > 0"),
    (["--trace", "{good}", "--tick", "nan"], "--tick must be"),
    (["--trace", "{good}", "--limit", "0"], "--limit must be >= 1"),
    (["--trace", "{good}", "--seed", "-1"], "--seed must be a whole number >= 0, got -1"),
    (["--trace", "{binary}"], "is not UTF-8 text (invalid start byte at byte 0)"),
    (["--trace", "{good}", "--nodes", "99999999999"], "--nodes x --gpus-per-node must be at most 1,000,000 GPUs"),
    (["--trace", "{good}", "--urgent-fraction", "nan"], "--urgent-fraction must be between 0 and 1"),
    (["--trace", "{good}", "--multi-rank", "all"], "unknown --multi-rank 'all'; use cooperative or none"),
    (["--trace", "{good}", "--estimates", "oracle"], "unknown --estimates 'oracle'; use predicted or none"),
    (["--trace", "{labels}"], "unknown class label(s) 'batch' (2 rows)"),
    (["--trace", "{good}", "--class-budget", "-1"], "--class-budget must be a number of GPU-hours >= 0"),
    (["--trace", "{good}", "--class-floor", "1"], "--class-floor must be a share between 0 and 1"),
    (["--trace", "{good}", "--class-floor", "nan"], "--class-floor must be"),
    (["--trace", "{good}", "--class-half-life", "0"], "--class-half-life must be a number of seconds > 0"),
    # an option another one overrides is refused, not dropped (issue 15, item 7)
    (["--trace", "{good}", "--compare", "--policy", "las"], "give --compare or --policy, not both"),
    (["--trace", "{good}", "--policy", "gpuswap", "--compare"], "give --compare or --policy, not both"),
    (["--trace", "{good}", "--strict-classes", "--class-budget", "10"], "give it or those options, not both"),
    (["--trace", "{good}", "--class-floor", "0.1", "--strict-classes"], "give it or those options, not both"),
])
def test_usage_errors_exit_64_with_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    (tmp_path / "good.csv").write_text("submit,duration,gpus\n0,10,1\n")
    (tmp_path / "labels.csv").write_text("submit,duration,gpus,class\n0,10,1,low\n1,10,1,batch\n2,10,1,batch\n")
    (tmp_path / "binary.csv").write_bytes(b"\xff\xfe\x00bin")
    argv = [a.format(bad=tmp_path / "bad.csv", good=tmp_path / "good.csv", labels=tmp_path / "labels.csv",
                     binary=tmp_path / "binary.csv") for a in argv]
    assert cli.run(parse(argv)) == 64
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_skipped_rows_and_rounded_gpus_are_reported_and_recorded(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("submit,duration,gpus\n0,10,0.5\n1,x,1\n2,-1,1\n3,10,0\n4,10,1\n")
    out = tmp_path / "out"
    assert cli.run(parse(["--trace", str(trace), "--policy", "fifo", "--nodes", "1", "--gpus-per-node", "1",
                          "--out", str(out)])) == 0
    err = capsys.readouterr().err
    assert ("skipped 3 malformed row(s): 2 duration not a positive number, e.g. line 3: 'x'; "
            "1 GPUs not a positive number, e.g. line 5: '0'") in err
    assert "1 job(s) asked for a fraction of a GPU; rounded up to whole GPUs" in err
    meta = json.loads((out / "summary.json").read_text())["_meta"]
    assert meta["skipped_by_reason"] == {"duration not a positive number": 2, "GPUs not a positive number": 1}
    assert (meta["skipped"], meta["rounded_gpus"], meta["jobs"]) == (3, 1, 2)


def test_python_m_gpuswap_sim_exits_64_on_a_bad_option(tmp_path):
    import subprocess
    import sys

    trace = tmp_path / "t.csv"
    trace.write_text("submit,duration,gpus\n0,10,1\n")
    for bad, message in ((["--tick", "abc"], "gpuswap sim: argument --tick: invalid float value: 'abc'"),
                         (["--min-runtime", "-5"], "gpuswap sim: --min-runtime must be a number of seconds "
                                                   ">= 0, got -5.0")):
        p = subprocess.run([sys.executable, "-m", "gpuswap.sim", "--trace", str(trace), *bad],
                           capture_output=True, text=True)
        assert (p.returncode, p.stderr.strip(), p.stdout) == (64, message, "")


def test_an_unusable_out_is_refused_before_simulating_and_a_failed_write_is_one_line(tmp_path):
    """`--out` under a file used to end the whole simulation in a NotADirectoryError traceback."""
    import subprocess
    import sys

    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,duration,num_gpus\n0,10,1\n5,20,1\n")
    a_file = tmp_path / "file"
    a_file.write_text("")

    def sim(out):
        return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "sim", "--trace", str(trace), "--nodes", "1",
                               "--out", out], capture_output=True, text=True, timeout=120)

    for out, message in ((f"{a_file}/x", f"--out '{a_file}/x': cannot make the directory: Not a directory"),
                         (str(a_file), f"--out '{a_file}' is not a directory"),
                         ("", "--out must name a directory, not an empty string")):
        p = sim(out)
        assert (p.returncode, p.stderr, p.stdout) == (64, f"gpuswap sim: {message}\n", ""), p   # nothing simulated
    out = tmp_path / "out"
    (out / "summary.json").mkdir(parents=True)      # where the first result goes: it cannot be replaced
    p = sim(str(out))
    assert p.returncode == 1 and p.stderr == f"gpuswap sim: cannot write the results to {out}: Is a directory\n", p
    assert "gpuswap" in p.stdout and "wrote" not in p.stdout        # simulated, then refused one line
    made = tmp_path / "made" / "here"
    assert sim(str(made)).returncode == 0 and (made / "summary.json").exists()


def test_reserve_after_reaches_the_policy_and_the_summary(tmp_path, capsys):
    """`--reserve-after`: recorded in summary.json with the wide jobs' figures; `abc` is refused
    with exit 64 like any bad option."""
    import subprocess
    import sys

    trace = tmp_path / "t.csv"
    trace.write_text("submit,duration,gpus\n0,10,1\n1,20,2\n")
    for value, recorded in (("never", None), ("90", 90.0)):
        out = tmp_path / value
        assert cli.run(parse(["--trace", str(trace), "--nodes", "1", "--gpus-per-node", "2",
                              "--reserve-after", value, "--out", str(out)])) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["_meta"]["reserve_after_s"] == recorded
        assert summary["gpuswap"]["wide"]["jobs"] == 1
    p = subprocess.run([sys.executable, "-m", "gpuswap.sim", "--trace", str(trace), "--reserve-after", "abc"],
                       capture_output=True, text=True)
    assert p.returncode == 64 and "--reserve-after" in p.stderr and p.stdout == "", p.stderr


def test_promotion_takes_starved_reaches_the_policy_config_and_the_summary(tmp_path, capsys):
    """gpuswap's promotion rule (policies.md, rule 4): on by default, `--promotion-takes-starved`
    gives the old one; summary.json records which ran."""
    trace = tmp_path / "t.csv"
    trace.write_text("submit,duration,gpus\n0,10,1\n")
    assert cli.policy_config(parse(["--trace", str(trace)])).promotion_spares_starved is True
    args = parse(["--trace", str(trace), "--promotion-takes-starved"])
    assert cli.policy_config(args).promotion_spares_starved is False
    for argv, recorded in (([], True), (["--promotion-takes-starved"], False)):
        out = tmp_path / str(recorded)
        assert cli.run(parse(["--trace", str(trace), "--nodes", "1", "--out", str(out), *argv])) == 0
        assert json.loads((out / "summary.json").read_text())["_meta"]["promotion_spares_starved"] is recorded


def test_compare_writes_summary_and_plots(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("submit,duration,gpus,user\n" + "".join(
        f"{i * 20},{[60, 900, 5000][i % 3]},{1 + (i % 4 == 0)},u{i % 3}\n" for i in range(90)))
    out = tmp_path / "out"
    rc = cli.run(parse(["--trace", str(trace), "--compare", "--nodes", "1", "--gpus-per-node", "4",
                        "--urgent-fraction", "0.5", "--out", str(out)]))
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    for policy in ("fifo", "priority", "las", "gandiva", "srtf-oracle", "gpuswap"):
        s = summary[policy]
        for key in ("avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "p99_queue_urgent_s",
                    "makespan_s", "utilization", "preemptions", "switch_gpu_s"):
            assert key in s
        assert 0 < s["utilization"] <= 1 and s["avg_jct_s"] >= 60
    assert summary["srtf-oracle"]["avg_jct_s"] <= summary["fifo"]["avg_jct_s"]
    assert (out / "jct_cdf.png").stat().st_size > 1000 and (out / "queue_by_class.png").exists()
    assert "gpuswap" in capsys.readouterr().out


def test_measured_switch_costs_come_from_a_daemons_gpus_json(tmp_path, capsys):
    """`--switch-cost measured:FILE` takes the bandwidths a real daemon measured (`gpuswap gpus
    --json`), so the simulator can replay a trace with this machine's parking costs."""
    from gpuswap.sim.costmodel import parse_cost_model

    gpus_json = tmp_path / "gpus.json"
    gpus_json.write_text(json.dumps({"gpus": [], "bandwidths": {
        "ram_park_bps": {"bytes_per_s": 50e9, "source": "calibrated"},
        "ram_resume_bps": {"bytes_per_s": 48e9, "source": "measured: 3 real move(s)"},
        "disk_write_bps": {"bytes_per_s": 2e9, "source": "calibrated"}}}))
    m = parse_cost_model(f"measured:{gpus_json}")
    assert (m.costs.ram_park_bps, m.costs.ram_resume_bps, m.costs.disk_write_bps) == (50e9, 48e9, 2e9)
    assert m.costs.disk_read_bps == parse_cost_model("gpuswap").costs.disk_read_bps   # default kept
    assert m.tiers == {"ram", "disk"} and "gpus.json" in m.name
    trace = tmp_path / "t.csv"
    trace.write_text("submit,duration,gpus\n0,100,1\n10,50,1\n")
    assert cli.run(parse(["--trace", str(trace), "--switch-cost", f"measured:{gpus_json}",
                          "--nodes", "1", "--gpus-per-node", "1"])) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"bandwidths": {"ram_park_bps": {"bytes_per_s": -1}}}))
    for spec, message in ((f"measured:{bad}", "must be a positive number"),
                          (f"measured:{tmp_path / 'missing.json'}", "cannot read it")):
        assert cli.run(parse(["--trace", str(trace), "--switch-cost", spec])) == 64
        assert message in capsys.readouterr().err
