"""The set-up script's output, the wheel's shipped drafter, and the warning when MLX is left on
its slow bundled BLAS (mlx imported before mlxspec could load OpenBLAS)."""

import ctypes.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLAS_SOURCE = ROOT / "mlxspec" / "_blas.py"
SOURCES = ("pyproject.toml", "README.md", "mlxspec", "models", "converters", "cli")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS only")


def _copy_sources(dest: Path, extra=()) -> Path:
    """The files a build needs, copied (building in the shared tree would write build/ there)."""
    for name in SOURCES + tuple(extra):
        src, dst = ROOT / name, dest / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return dest


# --- 12: the wheel holds the shipped drafter and the build does not warn about it ----------------

def test_wheel_ships_trained_drafter_without_build_warnings(tmp_path):
    pytest.importorskip("setuptools", minversion="68")  # the build backend, without isolation
    src = _copy_sources(tmp_path / "src")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    output = build.stdout + build.stderr
    assert "absent from the `packages` configuration" not in output
    assert "recognized as an importable package" not in output
    (wheel,) = (tmp_path / "dist").glob("mlxspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = ROOT / "mlxspec" / "drafters" / "trained"
    expected = {f"mlxspec/drafters/trained/{p.relative_to(shipped).as_posix()}"
                for p in shipped.glob("*/*") if p.suffix in (".json", ".safetensors")}
    assert {Path(n).name for n in expected} >= {
        "config.json", "target.json", "draft_vocab.json", "model.safetensors"}
    assert expected <= names


# --- 11: the set-up prints a short summary; a failing step still shows and fails --------------

def _quietly(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run a command through setup.sh's own `quietly` helper."""
    script = (ROOT / "scripts" / "setup.sh").read_text()
    helper = script[script.index("quietly() {"):]
    helper = helper[:helper.index("\n}\n") + 3]
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; step_log=step.log\n{helper}{command}\necho after"],
        capture_output=True, text=True, cwd=cwd, timeout=60)


def test_setup_step_output_hidden_on_success_shown_on_failure(tmp_path):
    ok = _quietly("quietly bash -c 'echo \"ERROR: resolver noise\"; echo WARNING >&2'", tmp_path)
    assert ok.returncode == 0 and ok.stdout == "after\n" and ok.stderr == ""
    failed = _quietly("quietly bash -c 'echo \"the real error\"; exit 3'", tmp_path)
    assert failed.returncode == 1 and "after" not in failed.stdout
    assert "the real error" in failed.stderr and "setup failed" in failed.stderr


def test_setup_runs_every_pip_and_apt_step_quietly():
    lines = (ROOT / "scripts" / "setup.sh").read_text().splitlines()
    steps = [line.strip() for line in lines if line.strip().startswith(("pip ", "apt-get "))]
    assert steps == [], f"steps whose output would reach the reader: {steps}"


SUMMARY = ("venv:", "package:", "default model:", "prompt sets:", "BLAS:")


@pytest.mark.slow
def test_setup_fresh_and_rerun_print_only_the_summary(tmp_path):
    """A fresh .venv, then a re-run after a dependency of the data-only packages went missing
    (pip's resolver then lists their unmet dependencies: an "ERROR" a newcomer reads as failure)."""
    repo = _copy_sources(tmp_path / "repo", extra=("scripts/setup.sh",))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}

    def setup():
        run = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stderr == ""
        lines = [line for line in run.stdout.splitlines() if not line.startswith("installed ")]
        assert [line.split(":")[0] + ":" for line in lines] == list(SUMMARY)
        return run.stdout

    try:
        out = setup()
        assert "mlxspec 0.1.0" in out and "HumanEval 164, MT-Bench 80" in out
        pip = [str(repo / ".venv" / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "tqdm"]
        subprocess.run(pip, check=True, capture_output=True)
        setup()
        assert "ERROR: pip's dependency resolver" in (repo / ".venv" / "setup.log").read_text()
    finally:
        shutil.rmtree(repo / ".venv", ignore_errors=True)  # ~1 GB


# --- 13: a warning when mlx.core came first and MLX is left on its reference BLAS --------------

def _python(code: str, **env) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter, every warning shown (a repeated one would show twice)."""
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=120)
    assert run.returncode == 0, run.stderr
    return run


MLX_FIRST = ("import mlx.core; import mlxspec; from mlxspec import _blas; _blas.preload_openblas();"
             " print(mlxspec.blas_in_use())")
OPENBLAS = ctypes.util.find_library("openblas") if sys.platform.startswith("linux") else None
needs_openblas = pytest.mark.skipif(OPENBLAS is None, reason="needs Linux with OpenBLAS installed")


@needs_openblas
def test_mlx_imported_first_warns_once_naming_the_fix():
    run = _python(MLX_FIRST)
    assert run.stderr.count("SlowBlasWarning") == 1, run.stderr
    assert "import mlxspec before mlx" in run.stderr.lower() and "LD_PRELOAD=" in run.stderr
    assert "mlx.core was imported before mlxspec" in run.stdout


@needs_openblas
def test_mlxspec_first_loads_openblas_without_warning():
    run = _python("import mlxspec; import mlx.core; print(mlxspec.blas_in_use())")
    assert "Warning" not in run.stderr and run.stdout.startswith("OpenBLAS")


@needs_openblas
def test_openblas_preloaded_before_mlx_does_not_warn():
    run = _python(MLX_FIRST, LD_PRELOAD=OPENBLAS)
    assert "Warning" not in run.stderr
    assert run.stdout.startswith("OpenBLAS") and "loaded before mlxspec" in run.stdout


@linux_only
def test_reference_blas_chosen_by_the_user_does_not_warn():
    run = _python(MLX_FIRST, MLXSPEC_BLAS="reference")
    assert "Warning" not in run.stderr and "MLXSPEC_BLAS=reference" in run.stdout


@linux_only
@pytest.mark.parametrize("mlx_first", [False, True])
def test_openblas_not_installed_says_so_once(mlx_first):
    """_blas.py loaded on its own, as on a machine without OpenBLAS (no candidate loads)."""
    code = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("blas_alone", {str(BLAS_SOURCE)!r})
blas = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blas)
blas._CANDIDATES = ("libopenblas-not-here.so.0",)
blas._openblas_on_disk = lambda: None
if {mlx_first}:
    import mlx.core
blas.preload_openblas(); print(blas.preload_openblas())
"""
    run = _python(code)
    assert run.stderr.count("SlowBlasWarning") == 1, run.stderr
    assert "OpenBLAS not found" in run.stderr and "imported before" not in run.stderr
    assert "OpenBLAS not found" in run.stdout
