"""atomic_output_dir: the output appears complete or not at all."""

import errno
import os
import stat
import tempfile

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


# ---- an output directory that cannot be written: the error names it and the fix


def deny_mkdtemp(monkeypatch):
    """What a read-only directory does to a non-root user; root writes anywhere, so a chmod
    cannot produce it where the tests run as root."""

    def mkdtemp(suffix=None, prefix=None, dir=None):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)


def test_parent_that_is_a_file_is_named(tmp_path):
    (tmp_path / "notes").write_text("")
    out = tmp_path / "notes" / "sub" / "model"
    with pytest.raises(NotADirectoryError) as err:
        with atomic_output_dir(out):
            pytest.fail("the body ran")
    assert str(err.value) == (f"cannot write into {out.parent} ({tmp_path / 'notes'} is a file): "
                              "choose another output directory (-o)")


def test_permission_denied_is_named(tmp_path, monkeypatch):
    deny_mkdtemp(monkeypatch)
    with pytest.raises(PermissionError) as err:
        with atomic_output_dir(tmp_path / "model"):
            pytest.fail("the body ran")
    assert str(err.value) == (f"cannot write into {tmp_path} (Permission denied): "
                              "choose another output directory (-o)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_named(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(PermissionError, match=f"cannot write into {tmp_path / 'ro'} .*-o"):
        with atomic_output_dir(tmp_path / "ro" / "model"):
            pytest.fail("the body ran")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux sysfs")
def test_filesystem_refusing_directories_is_named():
    """sysfs refuses new directories even to root: a real write failure wherever tests run."""
    with pytest.raises(OSError, match=r"cannot write into /sys/kernel \(.*\): .*\(-o\)"):
        with atomic_output_dir("/sys/kernel/mlxspec-test-model"):
            pytest.fail("the body ran")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("writer", ["python", "mlx"])
def test_disk_full_is_named_and_leaves_nothing(tmp_path, writer):
    """Writes to /dev/full fail with ENOSPC: a disk that fills up during a conversion. MLX's
    writer raises RuntimeError for it, Python's OSError; both become one OSError naming out."""
    import mlx.core as mx

    out = tmp_path / "model"
    with pytest.raises(OSError) as err:
        with atomic_output_dir(out) as tmp:
            os.symlink("/dev/full", tmp / "model.safetensors")
            if writer == "python":
                (tmp / "model.safetensors").write_bytes(b"\0" * 65536)
            else:
                mx.save_safetensors(str(tmp / "model.safetensors"), {"w": mx.zeros((65536,))})
    assert str(err.value).startswith(f"writing {out} failed (")
    assert str(err.value).endswith(f"check the free space in {tmp_path} or write elsewhere "
                                   "(-o; MLXSPEC_CACHE for the model cache)")
    assert os.listdir(tmp_path) == []


def _published_meanwhile(source, out, dtype):
    """`convert` as it ends when another process published the same output first."""
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    raise FileExistsError(f"Output directory {out} appeared during the conversion.")


def test_a_cache_conversion_another_process_finished_first_is_used(tmp_path, monkeypatch):
    """Two processes converting the same model into the cache at once (two CLI runs on a fresh
    machine): the one that publishes second uses the other's complete directory."""
    import mlxspec.converters as converters
    from mlxspec.loading import _converted_once

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(converters, "convert", _published_meanwhile)
    out = _converted_once("source", "model-float32", "float32")
    assert out == tmp_path / "models" / "model-float32"
    assert (out / "config.json").is_file()


def test_a_cache_conversion_that_fails_otherwise_still_fails(tmp_path, monkeypatch):
    import mlxspec.converters as converters
    from mlxspec.loading import _converted_once

    def refused(source, out, dtype):
        raise FileExistsError("something else exists")

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(converters, "convert", refused)
    with pytest.raises(FileExistsError, match="something else"):
        _converted_once("source", "model-float32", "float32")
