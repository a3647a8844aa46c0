"""Writes that fail (a full disk, a read-only folder) and files that are damaged (truncated safetensors, offsets past
the end) give one sentence, leave nothing half-written and keep the previous file."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import library.caching.strategies as sm
from library.errors import UserError
from library.files import safetensors_io
from library.files.safetensors_io import WriteError, load_safetensors, read_safetensors_header, save_file_atomic
from library.training import state_io
from tests.small_disk import fill, mounted_tmpfs


class MainProcess:
    """The part of an Accelerator that `state_io.save_state_folder` uses, for one process."""

    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------------------------ a full disk
@pytest.fixture
def small_disk(tmp_path):
    with mounted_tmpfs(tmp_path / "disk", 768) as folder:
        if folder is None:
            pytest.skip("mounting a tmpfs needs root on Linux")
        yield folder


def test_full_disk_lora_save_is_a_sentence_and_keeps_the_previous_file(small_disk):
    target = small_disk / "toy.safetensors"
    save_file_atomic({"w": torch.ones(16)}, target)
    with pytest.raises(WriteError, match=r"No space left on the disk of .*'toy.safetensors'.*free some space") as e:
        save_file_atomic({"w": torch.zeros(400_000)}, target)  # 1.6 MB on a 768 KiB disk
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert _files(small_disk) == ["toy.safetensors"]  # no temp file left
    assert torch.equal(load_safetensors(target)["w"], torch.ones(16))


def test_full_disk_latent_cache_write_is_a_sentence(small_disk):
    target = small_disk / "img_0064x0064_moss.npz"
    with pytest.raises(WriteError, match="No space left.*img_0064x0064_moss.npz"):
        sm.save_npz_atomic(target, {"latents_8x8": np.zeros((32, 200, 200), np.float32)})
    assert _files(small_disk) == []


def test_full_disk_state_save_keeps_the_previous_state(small_disk):
    folder = small_disk / "toy-state"

    def write(size: int):
        def fill_temp(temp: Path) -> None:
            torch.save({"m": torch.zeros(size)}, temp / "optimizer.bin")  # what accelerate's save_state does
            (temp / "train_state.json").write_text("{}")
        return fill_temp

    state_io.save_state_folder(folder, write(8), MainProcess())
    before = state_io.verify_folder(folder)
    fill(small_disk, leave_bytes=64 * 1024)
    with pytest.raises(WriteError, match="No space left.*training state 'toy-state'"):
        state_io.save_state_folder(folder, write(100_000), MainProcess())
    assert state_io.verify_folder(folder) == before  # the previous state, whole
    assert sorted(p.name for p in small_disk.iterdir() if p.name.startswith(".")) == []  # no temp folder


def test_write_errors_of_other_writers_are_recognised(tmp_path, monkeypatch):
    """safetensors reports the errno in its message; numpy raises OSError: both become the same sentence."""
    import safetensors.torch

    def rust_full(*a, **k):
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", rust_full)
    with pytest.raises(WriteError, match="No space left") as e:
        save_file_atomic({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    assert e.value.errno == errno.ENOSPC

    def numpy_full(file, **arrays):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", numpy_full)
    with pytest.raises(WriteError, match="No space left"):
        sm.save_npz_atomic(tmp_path / "b_moss_te.npz", {"a": np.zeros(2)})
    assert _files(tmp_path) == []

    def other_failure(*a, **k):
        raise ValueError("not an OS problem")

    monkeypatch.setattr(safetensors.torch, "save_file", other_failure)
    with pytest.raises(ValueError, match="not an OS problem"):  # left alone: a programming error stays one
        save_file_atomic({"w": torch.ones(2)}, tmp_path / "c.safetensors")


# ----------------------------------------------------------------------------------------- read-only folders
@pytest.fixture
def read_only_folder(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", 64, read_only=True) as folder:
        if folder is not None:
            yield folder
            return
    folder = tmp_path / "ro"  # not root: permissions do it
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def test_read_only_folder_is_a_sentence(read_only_folder):
    from library.training.output_folder import check_output_dir

    with pytest.raises(WriteError, match="is not writable"):
        save_file_atomic({"w": torch.ones(2)}, read_only_folder / "a.safetensors")
    with pytest.raises(UserError, match="is not writable"):
        check_output_dir(str(read_only_folder))
    with pytest.raises(UserError, match="is not writable"):
        check_output_dir(str(read_only_folder / "sub"))  # cannot even be made


def test_a_file_where_a_folder_belongs(tmp_path):
    from library.training.output_folder import check_output_dir

    (tmp_path / "plain").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        check_output_dir(str(tmp_path / "plain"))
    with pytest.raises(UserError, match="is a file, not a folder"):
        save_file_atomic({"w": torch.ones(2)}, tmp_path / "plain" / "a.safetensors")


# ------------------------------------------------------------------------------------ damaged safetensors
def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    save_file_atomic({"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(4, 4)}, path, {"room": "x" * 64})
    return path


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    header.pop("__metadata__")  # the room the edit may need
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # same length: the data section stays where it was
    assert len(text) == n
    path.write_bytes(raw[:8] + text + raw[8 + n:])


@pytest.mark.parametrize("disable_mmap", [False, True])
def test_truncated_file_is_a_sentence(tmp_path, disable_mmap):
    path = _saved(tmp_path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(UserError, match="m.safetensors.*truncated.*re-download or re-create"):
        load_safetensors(path, disable_mmap=disable_mmap)


@pytest.mark.parametrize("disable_mmap", [False, True])
def test_offsets_past_the_end_are_a_sentence(tmp_path, disable_mmap):
    path = _saved(tmp_path)

    def past_the_end(header):
        start, end = header["b"]["data_offsets"]
        header["b"]["data_offsets"] = [start + 10**6, end + 10**6]

    _rewrite_header(path, past_the_end)
    with pytest.raises(UserError, match="tensor 'b' spans bytes .* \\(the file is truncated\\)"):
        load_safetensors(path, disable_mmap=disable_mmap)


def test_shape_and_size_disagree(tmp_path):
    path = _saved(tmp_path)

    def bigger_shape(header):
        header["b"]["shape"] = [4, 5]

    _rewrite_header(path, bigger_shape)
    with pytest.raises(UserError, match="tensor 'b' .*shape \\[4, 5\\].* bytes instead"):
        read_safetensors_header(path)


def test_malformed_header_entries(tmp_path):
    path = _saved(tmp_path)

    def negative(header):
        header["a"]["shape"] = [-64]

    _rewrite_header(path, negative)
    with pytest.raises(UserError, match="tensor 'a' has a malformed header entry"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 4) + b"[1 ]")
    with pytest.raises(UserError, match="not a JSON object"):
        read_safetensors_header(path)


def test_written_files_are_synced_before_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    save_file_atomic({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    assert calls == ["fsync", "replace", "fsync"]  # the file, the rename, the folder


def test_leftover_temp_files_match_only_the_writers_pattern(tmp_path):
    (tmp_path / ".toy.safetensors.abcd1234.tmp").write_bytes(b"x")
    (tmp_path / ".toy.safetensors.abcd1234.tmp.npz").write_bytes(b"x")
    (tmp_path / ".toy.safetensors.partial").write_bytes(b"x")  # not ours
    (tmp_path / "toy.safetensors.abcd1234.tmp").write_bytes(b"x")  # not ours (no dot)
    found = safetensors_io.leftover_temp_files(tmp_path, lambda target: target == "toy.safetensors")
    assert [p.name for p in found] == [".toy.safetensors.abcd1234.tmp", ".toy.safetensors.abcd1234.tmp.npz"]


def test_stale_temp_files_of_cache_files_are_removed_young_ones_kept(tmp_path):
    import time

    target = tmp_path / "img_moss_te.npz"
    old, young = tmp_path / ".img_moss_te.npz.aaaa1111.tmp.npz", tmp_path / ".img_moss_te.npz.bbbb2222.tmp.npz"
    other = tmp_path / ".img2_moss_te.npz.cccc3333.tmp.npz"
    for path in (old, young, other):
        path.write_bytes(b"half")
    past = time.time() - safetensors_io.STALE_TEMP_SECONDS - 5
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert safetensors_io.remove_stale_temp_files([target]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, other.name])  # a live write stays
