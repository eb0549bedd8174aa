"""Ray is an optional extra: without `--ray` nothing imports it, and without it `--ray` says so in
one line (exit 69). These run whether or not Ray is installed (it is hidden from the child)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# `import ray` fails in the child as if Ray were not installed.
NO_RAY = "import sys; sys.modules['ray'] = None\n"


def run(code: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUSWAP_HOME=str(home))
    env.pop("GPUSWAP_CONFIG", None)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


def test_without_ray_flag_nothing_imports_ray(tmp_path):
    code = ("import sys\n"
            "import gpuswap.cli.main, gpuswap.cli.server, gpuswap.node.daemon, gpuswap.api.serving, gpuswap.node.pool\n"
            "print('ray' in sys.modules)")
    r = run(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_ray_flag_without_ray_installed_is_one_line_and_exit_69(tmp_path):
    code = NO_RAY + "from gpuswap.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = run(code, tmp_path / "home", "server", "--ray", "auto", "--no-calibrate")
    assert r.returncode == 69, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert 'pip install "gpuswap[ray]"' in lines[0] and lines[0].startswith("gpuswap server: --ray needs Ray")


def test_ray_flag_with_simulated_gpus_is_a_usage_error(tmp_path):
    code = NO_RAY + "from gpuswap.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = run(code, tmp_path / "home", "server", "--ray", "auto", "--simulate-gpus", "1")
    assert r.returncode == 64, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "GPUSWAP_AGENT_SIMULATE_GPUS" in r.stderr


def test_a_bad_ray_address_is_a_usage_error(tmp_path):
    code = NO_RAY + "from gpuswap.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = run(code, tmp_path / "home", "server", "--ray", "not an address")
    assert r.returncode == 64, (r.stdout, r.stderr)
    assert "--ray 'not an address'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_agent_is_one_per_state_directory_and_serves_a_node_without_gpus(tmp_path):
    """The node-local half alone (no Ray): a node where NVML finds no GPU is in the pool with none
    (a CPU-only head), and a second agent on the same state directory is refused."""
    import pytest

    from gpuswap.node.agent import AgentError, NodeAgent
    from gpuswap_testing import has_gpu

    if has_gpu():
        pytest.skip("NVML finds a GPU here: this node is not one without")
    env = {"GPUSWAP_AGENT_HOME": str(tmp_path / "agent"), "GPUSWAP_NODE_NAME": "cpu-only"}
    agent = NodeAgent(60.0, env)
    info = agent.info()
    assert info["name"] == "cpu-only" and agent.gpus() == [] and not info["transparent"]
    assert info["describe"].startswith("no GPU (")
    with pytest.raises(AgentError, match="another gpuswap agent already serves"):
        NodeAgent(60.0, env)
