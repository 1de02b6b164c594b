"""Where benchmarks/run_all.py writes its results (a user's run leaves the clone unchanged), and that the
README names the machines as the committed results recorded them."""
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_ALL = os.path.join(ROOT, "benchmarks", "run_all.py")
COMMITTED = os.path.join(ROOT, "benchmarks", "results")

pytestmark = pytest.mark.skipif(not os.path.isfile(RUN_ALL), reason="needs the source tree's benchmarks/ "
                                "(these tests were copied out of it)")


def committed_digests():
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(pathlib.Path(COMMITTED).iterdir())}


def run_quick(*arguments):
    result = subprocess.run([sys.executable, RUN_ALL, "--quick", *arguments], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def git_status():
    result = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
                    reason="needs git and a git checkout of the project")
def test_a_run_with_the_default_folder_leaves_git_status_as_it_was():
    before, digests = git_status(), committed_digests()
    out = run_quick()
    default = os.path.join(ROOT, "build", "benchmarks")
    assert f"Results written to {default} (the committed ones in benchmarks/results/ are unchanged" in out
    assert re.search(r"^Machine: .+, \d+ cores; cai_dlpack ", pathlib.Path(default, "cpu.md").read_text(),
                     re.MULTILINE)
    assert git_status() == before
    assert committed_digests() == digests


def test_a_run_writes_to_the_folder_given(tmp_path):
    digests = committed_digests()
    out = run_quick("--out", str(tmp_path / "results"))
    assert f"Results written to {tmp_path / 'results'} " in out
    assert "| **converter alone, 2-d float32**" in (tmp_path / "results" / "cpu.md").read_text()
    assert committed_digests() == digests


@pytest.mark.parametrize("arguments, refusal", [
    (["--out", "elsewhere", "--update-committed"], "argument --update-committed: not allowed with argument --out"),
    (["--quick", "--update-committed"], "--quick makes a partial run, which must not replace the committed results"),
    (["--quick", "--instructions"], "--quick and --instructions are two different runs; ask for one"),
])
def test_replacing_the_committed_results_is_asked_for_alone(arguments, refusal):
    digests = committed_digests()
    result = subprocess.run([sys.executable, RUN_ALL, *arguments], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 2 and refusal in result.stderr, result.stderr
    assert committed_digests() == digests


def test_the_readme_names_the_machines_as_the_committed_runs_reported_them():
    readme = " ".join(pathlib.Path(ROOT, "README.md").read_text().split())  # as read, whatever the wrapping
    cpu = pathlib.Path(COMMITTED, "cpu.md").read_text()
    machine = re.search(r"^Machine: ([^;]+);", cpu, re.MULTILINE).group(1)
    assert f"the machine as the run reported it: {machine};" in readme, machine
    gpu = pathlib.Path(COMMITTED, "gpu.md").read_text()
    device = re.search(r"^GPU: ([^;]+);", gpu, re.MULTILINE).group(1)
    assert f"On a GPU (one {device}," in readme, device


def load_instructions():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cdl_instructions_bench",
                                                  os.path.join(ROOT, "benchmarks", "instructions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_instruction_counts_run_with_randomization_on_where_setarch_is_missing_or_refused(tmp_path, monkeypatch,
                                                                                         capfd):
    """benchmarks/instructions.py turns address-space randomization off only where setarch can: without setarch,
    or where it fails (a container's seccomp profile may refuse the personality call), the run goes on with it on,
    and the refusal prints nothing."""
    instructions = load_instructions()
    monkeypatch.setenv("PATH", str(tmp_path))
    assert instructions.fixed_layout_prefix() == []
    refusing = tmp_path / "setarch"
    refusing.write_text("#!/bin/sh\necho 'setarch: failed to set personality: Operation not permitted' >&2\nexit 1\n")
    refusing.chmod(0o755)
    capfd.readouterr()
    assert instructions.fixed_layout_prefix() == []
    assert capfd.readouterr() == ("", "")
    accepting = tmp_path / "setarch"
    accepting.write_text('#!/bin/sh\nshift 2\nexec "$@"\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert instructions.fixed_layout_prefix()[0] == "setarch"
