"""The wheel's shipped drafter."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "mlxspec", "models", "converters", "cli")


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
