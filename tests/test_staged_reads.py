"""The staged reader of library.files.safetensors_io (chunked preadv into staging buffers, then copies into each
tensor's own memory): the chunk plan, exact tensors in every dtype, key subsets, fused splits, damaged files, and the
loaders through it. On the CPU the staged path runs with plain buffers (`staged=True`); CUDA adds pinned buffers and
events around the same code."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from library.errors import UserError
from library.files import safetensors_io as st
from library.files.safetensors_io import (
    SafetensorsFile,
    SplitSpec,
    SplitTensorAdapter,
    TensorSource,
    plan_chunks,
    save_file_atomic,
    stream_tensors,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.uint8]
    out = {}
    for i in range(30):
        rows = int(torch.randint(1, 40, (1,), generator=g))
        dtype = dtypes[i % len(dtypes)]
        value = torch.randn(rows, 5, generator=g) * 50
        out[f"t{i:02d}"] = value.to(dtype)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 4)
    out["flags"] = torch.tensor([True, False, True])
    return out


@pytest.fixture()
def file(tmp_path):
    tensors = _tensors()
    path = tmp_path / "m.safetensors"
    save_file_atomic(tensors, path)
    return path, tensors


def test_chunk_plan_covers_every_byte_once():
    spans = [(0, 10), (10, 300), (5000, 5001), (5001, 5200), (5300, 9000)]
    chunks = plan_chunks(spans, chunk_bytes=256, gap_bytes=100)
    for chunk in chunks:
        assert 0 < chunk.end - chunk.start <= 256
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks:
        for index, at, offset, length in chunk.pieces:
            assert spans[index][0] + at == chunk.start + offset  # the piece's file offset, seen from both sides
            covered.setdefault(index, []).append((at, length))
    for index, (start, end) in enumerate(spans):
        pieces = sorted(covered[index])
        assert pieces[0][0] == 0 and sum(n for _, n in pieces) == end - start
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(pieces))
    assert [i for c in chunks for i in c.completes] == list(range(len(spans)))
    assert any(c.start == 5000 for c in chunks)  # the 4700-byte gap starts a new read
    # a gap up to gap_bytes is read through, a larger one is skipped
    assert [(c.start, c.end) for c in plan_chunks([(0, 10), (110, 120)], 1024, 100)] == [(0, 120)]
    assert [(c.start, c.end) for c in plan_chunks([(0, 10), (111, 120)], 1024, 100)] == [(0, 10), (111, 120)]


@pytest.mark.parametrize(("chunk", "buffers", "threads"), [(64, 2, 1), (100, 3, 2), (1 << 20, 4, 4)])
def test_stream_gives_the_exact_tensors(file, chunk, buffers, threads):
    path, tensors = file
    keys = [k for k in tensors if k != "t07"][::-1]  # a subset, asked in another order than the file's
    with SafetensorsFile(path) as f:
        out = list(stream_tensors(f, keys, "cpu", chunk_bytes=chunk, buffers=buffers, threads=threads))
        assert f.reads == len(keys) - 1  # the empty tensor needs no read
    assert sorted(k for k, _ in out) == sorted(keys)
    for key, tensor in out:
        assert tensor.dtype == tensors[key].dtype and tensor.shape == tensors[key].shape, key
        assert torch.equal(tensor, tensors[key]), key
    # each tensor has memory of its own (a later merge that replaces one frees it)
    storages = {t.untyped_storage().data_ptr() for _, t in out if t.numel()}
    assert len(storages) == sum(1 for _, t in out if t.numel())


def test_stream_times_count_the_calls_and_the_bytes(file):
    path, tensors = file
    st.STREAM_TIMES.reset()
    with SafetensorsFile(path) as f:
        for _ in stream_tensors(f, list(tensors), "cpu", chunk_bytes=100, buffers=2, threads=2):
            pass
        for _ in stream_tensors(f, ["t00"], "cpu"):
            pass
    times = st.STREAM_TIMES.as_dict()
    assert times["calls"] == 2
    assert times["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values()) + tensors["t00"].nbytes
    assert all(times[k] >= 0 for k in ("setup_s", "read_wait_s", "copy_s", "consumer_s", "drain_s"))
    st.STREAM_TIMES.reset()
    assert st.STREAM_TIMES.calls == 0 and st.STREAM_TIMES.bytes == 0 and st.STREAM_TIMES.read_wait_s == 0


def test_tensor_source_and_split_adapter_staged_equals_per_tensor(tmp_path):
    g = torch.Generator().manual_seed(1)
    a = {"x.proj.qkv.weight": torch.randn(12, 4, generator=g).bfloat16(), "x.norm.weight": torch.randn(4, generator=g)}
    b = {"y.proj.o.weight": torch.randn(4, 4, generator=g)}
    save_file_atomic(a, tmp_path / "m-00001-of-00002.safetensors")
    save_file_atomic(b, tmp_path / "m-00002-of-00002.safetensors")
    shards = [tmp_path / "m-00001-of-00002.safetensors", tmp_path / "m-00002-of-00002.safetensors"]
    spec = SplitSpec("x.proj.qkv.weight", ("x.proj.q.weight", "x.proj.k.weight", "x.proj.v.weight"), (4, 4, 4))
    for disable_mmap in (False, True):
        adapter = SplitTensorAdapter(TensorSource(shards, disable_mmap=disable_mmap), [spec])
        keys = adapter.keys()
        plain = dict(adapter.iter_tensors(keys, "cpu", staged=False))
        staged = dict(adapter.iter_tensors(keys, "cpu", staged=True))
        assert set(plain) == set(staged) == set(keys)
        for key in keys:
            assert torch.equal(plain[key], staged[key]) and plain[key].dtype == staged[key].dtype, key
        assert torch.equal(staged["x.proj.k.weight"], a["x.proj.qkv.weight"][4:8])
        only_v = dict(adapter.iter_tensors(["x.proj.v.weight"], "cpu", staged=True))
        assert list(only_v) == ["x.proj.v.weight"]
        adapter.source.close()


def test_file_truncated_after_the_header_check_is_one_sentence(file):
    path, tensors = file
    f = SafetensorsFile(path)
    os.truncate(path, os.path.getsize(path) - 40)
    with pytest.raises(UserError, match="ended while reading its tensors .*truncated or replaced during the load"):
        list(stream_tensors(f, list(tensors), "cpu", chunk_bytes=128))
    f.close()


def test_default_device_reads_stay_per_tensor_on_the_cpu(file, monkeypatch):
    path, tensors = file
    calls = []
    monkeypatch.setattr(st, "stream_tensors", lambda *a, **k: calls.append(a) or iter(()))
    with TensorSource([path]) as source:
        out = dict(source.iter_tensors(source.keys(), "cpu"))
    assert not calls and set(out) == set(tensors)  # the CPU keeps the memory-mapped tensors (no copy)
    monkeypatch.setattr(st, "DIRECT_DEVICE_READS", False)
    assert st.read_device(torch.device("cuda")) == torch.device("cpu")
    monkeypatch.setattr(st, "DIRECT_DEVICE_READS", True)
    assert st.read_device(torch.device("cuda")) == torch.device("cuda")


def test_loaders_through_the_staged_reader_match(tiny_snapshot, monkeypatch):
    """The DiT (official and ComfyUI fused layouts) and the text encoder read through the staged path equal the
    per-tensor path bit for bit."""
    from library.moss_image.loaders import load_moss_image_model
    from library.text_encoder.qwen35 import load_qwen35_text_model

    streamed = []
    stream = st.stream_tensors
    monkeypatch.setattr(st, "stream_tensors", lambda f, *a, **k: streamed.append(f.path.name) or stream(f, *a, **k))

    def loaded(staged: bool) -> list[dict[str, torch.Tensor]]:
        original = TensorSource.iter_tensors

        def forced(self, keys, device="cpu", staged_arg=None):
            return original(self, keys, device, staged)

        monkeypatch.setattr(TensorSource, "iter_tensors", forced)
        try:
            models = [load_moss_image_model("cpu", tiny_snapshot / "transformer"),
                      load_moss_image_model("cpu", tiny_snapshot / "moss_image_base_bf16.safetensors"),
                      load_qwen35_text_model(tiny_snapshot / "text_encoder")]
        finally:
            monkeypatch.setattr(TensorSource, "iter_tensors", original)
        return [m.state_dict() for m in models]

    plain_models = loaded(False)
    assert streamed == []
    staged_models = loaded(True)
    assert "moss_image_base_bf16.safetensors" in streamed and len(streamed) >= 3  # every file went through it
    for plain, staged in zip(plain_models, staged_models):
        assert plain.keys() == staged.keys()
        for key in plain:
            assert torch.equal(plain[key], staged[key]), key
