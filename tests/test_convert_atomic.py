"""atomic_output_dir: the output appears complete or not at all."""

import os
import stat

import pytest

from mlxspec.converters.atomic import atomic_output_dir


def _hidden(parent):
    return [p for p in os.listdir(parent) if p.startswith(".")]


def test_success_renames_into_place(tmp_path):
    out = tmp_path / "sub" / "model"
    with atomic_output_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".model.partial-")
        (tmp / "config.json").write_text("{}")
        assert not out.exists()
    assert (out / "config.json").read_text() == "{}"
    assert not _hidden(out.parent)
    mode = stat.S_IMODE(os.stat(out).st_mode)
    assert mode & stat.S_IRGRP  # not mkdtemp's 0700


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_removes_everything(tmp_path, error):
    out = tmp_path / "model"
    with pytest.raises(error):
        with atomic_output_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise error("interrupted")
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_existing_dir_refused_before_the_body_runs(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    ran = []
    with pytest.raises(FileExistsError, match="overwrite"):
        with atomic_output_dir(out):
            ran.append(True)
    assert not ran and not _hidden(tmp_path)


def test_overwrite_replaces_and_failed_overwrite_keeps_old(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "new").write_text("new")
            raise RuntimeError
    assert (out / "old").exists() and not (out / "new").exists()
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert (out / "new").exists() and not (out / "old").exists()
    assert not _hidden(tmp_path)


def test_dir_created_meanwhile_is_not_clobbered(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(FileExistsError):
        with atomic_output_dir(out) as tmp:
            (tmp / "x").write_text("x")
            out.mkdir()  # e.g. a concurrent conversion finished first
    assert out.is_dir() and os.listdir(out) == []
    assert not _hidden(tmp_path)
