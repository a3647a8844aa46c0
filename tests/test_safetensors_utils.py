import os

import pytest
import torch

from library.errors import UserError
from library.files.safetensors_io import (
    SplitSpec,
    SplitTensorAdapter,
    TensorSource,
    discover_shards,
    load_safetensors,
    read_metadata,
    save_file_atomic,
)


def _write(path, tensors, metadata=None):
    save_file_atomic(tensors, path, metadata)
    return path


@pytest.mark.parametrize("disable_mmap", [False, True])
def test_roundtrip_all_dtypes(tmp_path, disable_mmap):
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.randint(-128, 127, (2, 3), dtype=torch.int8),
        "d": torch.tensor(list(b'{"x": 1}'), dtype=torch.uint8),
        "e": torch.randn(2, 2).half(),
        "empty": torch.zeros(0, 3),
    }
    p = _write(tmp_path / "m.safetensors", tensors, {"k": "v"})
    loaded = load_safetensors(p, disable_mmap=disable_mmap)
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)
    assert read_metadata(p) == {"k": "v"}


def test_key_filter_reads_nothing_else(tmp_path):
    p = _write(tmp_path / "m.safetensors", {"keep.w": torch.ones(2), "skip.w": torch.ones(2)})
    with TensorSource([p], key_filter=lambda k: k.startswith("keep.")) as src:
        assert src.keys() == ["keep.w"]
        src.get_tensor("keep.w")
        assert src.reads == 1


def test_discover_shards_both_spellings(tmp_path):
    for name in ("model-0000{i}-of-00003.safetensors", "model.safetensors-0000{i}-of-00003.safetensors"):
        d = tmp_path / name[:5].replace(".", "_") / name.split("-")[0]
        d.mkdir(parents=True)
        for i in (1, 2, 3):
            _write(d / name.format(i=i), {f"t{i}": torch.ones(1)})
        shards = discover_shards(d / name.format(i=1))
        assert [s.name for s in shards] == [name.format(i=i) for i in (1, 2, 3)]


def test_missing_shard_is_clear_error(tmp_path):
    _write(tmp_path / "x-00001-of-00002.safetensors", {"a": torch.ones(1)})
    with pytest.raises(UserError, match="x-00002-of-00002.safetensors"):
        discover_shards(tmp_path / "x-00001-of-00002.safetensors")


def test_single_file_is_its_own_shard(tmp_path):
    p = _write(tmp_path / "single.safetensors", {"a": torch.ones(1)})
    assert discover_shards(p) == [p]


@pytest.mark.parametrize("name", ["model.ckpt", "model.bin", "model.pt"])
def test_non_safetensors_rejected(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(b"\0" * 16)
    with pytest.raises(UserError, match="only safetensors"):
        load_safetensors(p)


def test_missing_and_corrupt_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_safetensors(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{{{{{")
    with pytest.raises(UserError, match="not a readable safetensors"):
        load_safetensors(bad)


@pytest.mark.parametrize("disable_mmap", [False, True])
def test_split_adapter_reads_each_fused_tensor_once(tmp_path, disable_mmap):
    qkv = torch.arange(24.0).reshape(6, 4)
    p = _write(tmp_path / "f.safetensors", {"blk.qkv.weight": qkv, "blk.o.weight": torch.ones(2, 2)})
    src = TensorSource([p], disable_mmap=disable_mmap)
    spec = SplitSpec("blk.qkv.weight", ("blk.q.weight", "blk.k.weight", "blk.v.weight"), (2, 2, 2))
    ad = SplitTensorAdapter(src, [spec])
    assert sorted(ad.keys()) == ["blk.k.weight", "blk.o.weight", "blk.q.weight", "blk.v.weight"]
    assert ad.shape("blk.k.weight") == (2, 4)
    got = {k: ad.get_tensor(k) for k in ("blk.v.weight", "blk.q.weight", "blk.k.weight")}
    assert src.reads == 1  # the fused tensor was read once for its three pieces
    assert torch.equal(torch.cat([got["blk.q.weight"], got["blk.k.weight"], got["blk.v.weight"]]), qkv)
    assert not ad._cache  # pieces leave the cache once served


def test_split_adapter_size_mismatch(tmp_path):
    p = _write(tmp_path / "f.safetensors", {"qkv": torch.ones(5, 2)})
    ad = SplitTensorAdapter(TensorSource([p]), [SplitSpec("qkv", ("q", "k", "v"), (2, 2, 2))])
    with pytest.raises(UserError, match="expected 6"):
        ad.get_tensor("q")


def test_atomic_save_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(Exception):
        save_file_atomic({"a": "not a tensor"}, tmp_path / "x.safetensors")  # type: ignore[dict-item]
    assert os.listdir(tmp_path) == []
