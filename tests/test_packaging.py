"""What gpuswap declares it needs is what it imports (issue 14): every third-party module the code
imports is a declared dependency, the daemon and the CLI run with none of the optional extras,
constraints/tested.txt pins the environment the tests run in, and CI runs README's commands."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "constraints"))
import freeze  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Import names that are not their distribution's name.
DIST_OF = {
    "pynvml": "nvidia-ml-py",
    "cuda": "cuda-bindings",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "prometheus_client": "prometheus-client",
    "pydantic_core": "pydantic-core",
}
EXTRAS = ("numpy", "matplotlib", "torch", "lightning", "pytorch_lightning", "transformers",
          "accelerate", "cuda")   # modules that only the optional extras bring


def dist_of(module: str) -> str:
    return canonicalize_name(DIST_OF.get(module, module))


def third_party_imports(top: Path) -> dict[str, set[str]]:
    """{top-level module: files} for every import under `top` (lazy ones inside functions and
    `importlib.import_module("x")` included) that is neither stdlib, gpuswap, nor a module of
    `top`'s own tree."""
    own = {p.stem for p in top.rglob("*.py")} | {p.name for p in top.rglob("*") if p.is_dir()}
    own = {"gpuswap"} if top.name == "src" else own | {"gpuswap"} | {p.stem for p in (ROOT / "constraints").glob("*.py")}
    found: dict[str, set[str]] = {}
    for path in sorted(top.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  in ("import_module", "__import__") and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            for name in names:
                mod = name.split(".")[0]
                if mod and mod not in sys.stdlib_module_names and mod not in own:
                    found.setdefault(mod, set()).add(str(path.relative_to(top.parent)))
    return found


def declared(extras: set[str]) -> set[str]:
    return {canonicalize_name(r.name) for r in freeze.project_requirements(extras)}


def test_the_import_scan_sees_lazy_imports_and_skips_stdlib(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "helper.py").write_text("")
    (pkg / "m.py").write_text("import os, json\nimport helper\nfrom yaml import safe_load\n"
                              "def f():\n    import numpy.linalg\n    importlib.import_module('scipy')\n")
    found = third_party_imports(pkg)
    assert set(found) == {"yaml", "numpy", "scipy"}
    assert [dist_of(m) for m in sorted(found)] == ["numpy", "scipy", "pyyaml"]


def test_every_import_in_src_is_declared():
    # The package: its core dependencies or one of its extras (never only through another package,
    # as pydantic came through fastapi, nor only in `test`).
    user = declared(set(PYPROJECT["optional-dependencies"]) - {"test"})
    missing = {f"{m} ({dist_of(m)}): {sorted(files)[0]}" for m, files in third_party_imports(ROOT / "src").items()
               if dist_of(m) not in user}
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


@pytest.mark.parametrize("tree", ["tests", "bench", "constraints"])
def test_every_import_in_tests_and_tools_is_in_the_test_extra(tree):
    allowed = declared({"test"})
    missing = {f"{m} ({dist_of(m)}): {sorted(files)[0]}" for m, files in third_party_imports(ROOT / tree).items()
               if dist_of(m) not in allowed}
    assert not missing, f"imported but not in gpuswap[test]: {sorted(missing)}"


def test_import_names_map_to_the_distributions_that_provide_them():
    """DIST_OF is checked against the installed packages' own records (where they are installed)."""
    providers = metadata.packages_distributions()
    seen = set()
    for tree in ("src", "tests", "bench"):
        seen |= set(third_party_imports(ROOT / tree))
    wrong = {m: providers[m] for m in seen
             if m in providers and dist_of(m) not in {canonicalize_name(d) for d in providers[m]}}
    assert not wrong, f"fix DIST_OF: {wrong}"


def test_optional_libraries_are_not_core_dependencies():
    core = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependencies"]}
    assert not core & {dist_of(m) for m in EXTRAS}
    assert {"numpy", "matplotlib"} <= {canonicalize_name(Requirement(r).name)
                                       for r in PYPROJECT["optional-dependencies"]["sim"]}


def test_the_test_extra_pins_torch_exactly():
    # An unpinned torch on a machine without it pulls the newest CUDA build (GBs); 2.13.0 is the
    # CPU build these machines install from a local file.
    torch = [Requirement(r) for r in PYPROJECT["optional-dependencies"]["test"] if Requirement(r).name == "torch"]
    assert [str(r.specifier) for r in torch] == ["==2.13.0"]


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / "tested.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_the_environment_the_tests_run_in():
    """Every distribution gpuswap[test] pulls in is pinned, at the version installed here
    (README's test command installs with the file; a new dependency needs `constraints/freeze.py`)."""
    want = _constraints()
    have = freeze.pins({"test"})
    unpinned = sorted(set(have) - set(want))
    assert not unpinned, f"not in constraints/tested.txt: {unpinned} (python constraints/freeze.py > constraints/tested.txt)"
    differ = {n: (want[n], v) for n, v in have.items() if want[n] != v}
    assert not differ, f"pinned != installed: {differ}"
    assert want["torch"] == "2.13.0"


def _code_line_after(text: str, heading: str) -> str:
    block = re.search(re.escape(heading) + r"[^`]*```\n(.+?)\n```", text, re.S)
    assert block, f"README has no command block after {heading!r}"
    return block.group(1).strip()


def test_ci_runs_exactly_readmes_test_command_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    demo = _code_line_after(readme, "Install and run the demo")
    test = _code_line_after(readme, "Install and run the tests:")
    assert demo.endswith("&& gpuswap demo") and '".[torch]"' in demo
    assert test.endswith("&& pytest") and '".[test]"' in test
    for command in (demo, test):
        assert "-c constraints/tested.txt" in command
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test in ci


def _absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: set[str]) -> list[str]:
    """Make every Python started from here on (daemon, jobs, CLI) see an install of gpuswap with
    `installed` extras: the optional modules those do not bring are absent (`import numpy` raises
    ModuleNotFoundError, importlib.util.find_spec('numpy') is None). Returns them."""
    have = declared(installed)
    absent = [m for m in EXTRAS if dist_of(m) not in have]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({absent!r}))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return absent


def test_daemon_and_cli_run_without_the_extras(tmp_path, monkeypatch, make_daemon):
    absent = _absent(tmp_path, monkeypatch, set())
    d = make_daemon()
    # The job (started by the daemon, under the same environment) sees no optional library either.
    probe = ("import importlib.util, sys; "
             f"sys.exit(3 if any(importlib.util.find_spec(m) for m in {absent!r}) else 0)")
    job = d.submit([sys.executable, "-c", probe], name="plain")
    assert d.state(job, "COMPLETED", "FAILED")["state"] == "COMPLETED"
    for verb in (["ls"], ["gpus"], ["show", str(job)]):
        res = d.cli(*verb)
        assert res.returncode == 0, res.stderr
    trace = tmp_path / "trace.csv"
    trace.write_text("submit,duration,gpus\n0,10,1\n")
    for argv in (["-m", "gpuswap.cli.main", "sim", "--trace", str(trace)], ["-m", "gpuswap.sim", "--trace", str(trace)]):
        res = subprocess.run([sys.executable, *argv], env=d.env, capture_output=True, text=True, timeout=120)
        assert (res.returncode, res.stdout) == (1, ""), res.stderr
        assert res.stderr == ("gpuswap sim: needs numpy and matplotlib, not installed here: "
                              "pip install 'gpuswap[sim]'\n")


def test_the_demos_training_job_runs_with_the_torch_extra_alone(tmp_path, monkeypatch):
    """README's demo installs `.[torch]` only; its job hashes parameters through Tensor.numpy()."""
    pytest.importorskip("torch", reason="torch is not installed: pip install 'gpuswap[torch]'")
    absent = _absent(tmp_path, monkeypatch, {"torch"})
    assert "matplotlib" in absent and "torch" not in absent
    out = tmp_path / "result.json"
    res = subprocess.run([sys.executable, "-m", "gpuswap.demo.train", "--steps", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "NumPy" not in res.stderr, res.stderr   # torch's warning when numpy is missing
    assert len(json.loads(out.read_text())["sha256"]) == 64
