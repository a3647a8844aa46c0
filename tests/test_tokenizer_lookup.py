"""Where the Qwen3.5 tokenizer comes from (library/text_encoder/qwen35.py `find_tokenizer_dir`): a snapshot's own
tokenizer/ before any cache or download, a Hugging Face cache found without the network, HF_HUB_OFFLINE (no network
attempt, one sentence), an unreachable Hub (one sentence within 10 s: an unroutable HF_ENDPOINT whose packets the
patched socket drops, a name lookup that hangs), and a download through a stand-in for the hub client. No test
reaches the network: every connection goes through a patched socket or a stand-in."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

import library.text_encoder.qwen35 as q
from library.errors import UserError

UNROUTABLE = "http://10.255.255.1"


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No offline switch, whatever the environment of the test run says."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    return monkeypatch


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> list:
    """huggingface_hub.snapshot_download replaced by a recorder that fails the test when it is reached."""
    import huggingface_hub

    calls: list = []

    def refuse(*args, **kwargs):
        calls.append((args, kwargs))
        raise AssertionError("snapshot_download was called")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    return calls


def hub_cache_with_tokenizer(cache: Path, source: Path) -> Path:
    """A Hugging Face cache layout holding MOSS-Image-Base's tokenizer/ (what a download leaves there)."""
    snap = cache / f"models--{q.TOKENIZER_REPO.replace('/', '--')}" / "snapshots" / "0123abcd"
    shutil.copytree(source, snap / q.TOKENIZER_SUBFOLDER)
    (cache / f"models--{q.TOKENIZER_REPO.replace('/', '--')}" / "refs").mkdir()
    (cache / f"models--{q.TOKENIZER_REPO.replace('/', '--')}" / "refs" / "main").write_text("0123abcd")
    return snap / q.TOKENIZER_SUBFOLDER


def test_the_snapshot_tokenizer_wins_over_a_cache_and_the_hub(tiny_snapshot, tmp_path, online, no_download,
                                                               monkeypatch):
    other = hub_cache_with_tokenizer(tmp_path / "cache", tiny_snapshot / "tokenizer")
    monkeypatch.setattr(q, "reachable", lambda *a, **k: pytest.fail("the network was checked"))
    te = str(tiny_snapshot / "text_encoder" / "model-00001-of-00004.safetensors")
    assert q.find_tokenizer_dir(str(tmp_path / "cache"), te) == tiny_snapshot / "tokenizer"
    assert q.find_tokenizer_dir(None, str(tiny_snapshot)) == tiny_snapshot / "tokenizer"
    assert q.find_tokenizer_dir(str(tmp_path / "cache"), None) == other  # no snapshot: the cache, still offline
    assert no_download == []
    tok = q.load_tokenizer(str(tmp_path / "cache"), te)
    assert len(q.tokenize(tok, "a red square")) > 0


@pytest.mark.parametrize("env", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_gives_one_sentence_without_touching_the_network(tmp_path, online, no_download, monkeypatch, env):
    monkeypatch.setenv(env, "1")
    monkeypatch.setattr(q, "reachable", lambda *a, **k: pytest.fail("the network was checked"))
    with pytest.raises(UserError) as err:
        q.load_tokenizer(str(tmp_path), None)
    message = str(err.value)
    assert "HF_HUB_OFFLINE is set" in message and "--tokenizer_cache_dir DIR" in message and "tokenizer.json" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    assert no_download == []


def test_local_files_only_never_downloads(tmp_path, online, no_download, monkeypatch):
    monkeypatch.setattr(q, "reachable", lambda *a, **k: pytest.fail("the network was checked"))
    with pytest.raises(UserError, match="not in local files .*--tokenizer_cache_dir DIR"):
        q.find_tokenizer_dir(str(tmp_path), None, local_files_only=True)


@pytest.fixture
def dropped_packets(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every TCP connection (the reachability check, a download) behaves as on a network that drops the packets: it
    waits for its timeout, then fails. Records the addresses asked for; no proxy from the environment."""
    asked: list = []

    def connect(address, timeout=None, *args, **kwargs):
        asked.append(address)
        time.sleep(min(timeout or 30.0, 30.0))
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", connect)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return asked


def test_an_unreachable_hub_gives_one_sentence_within_ten_seconds(tmp_path, online, no_download, dropped_packets,
                                                                   monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", UNROUTABLE)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        q.load_tokenizer(str(tmp_path), None)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert f"the Hugging Face Hub ({UNROUTABLE}) does not answer within 3 s" in message
    assert "--tokenizer_cache_dir DIR" in message and message.count(". ") == 0
    assert dropped_packets == [("10.255.255.1", 80)] and no_download == []


def test_a_name_lookup_that_hangs_is_cut_short(tmp_path, online, no_download, monkeypatch):
    def hang(*args, **kwargs):
        time.sleep(30)
        raise OSError("never answered")

    monkeypatch.setattr(socket, "create_connection", hang)
    monkeypatch.setattr(socket, "getaddrinfo", hang)
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    start = time.monotonic()
    with pytest.raises(UserError, match="does not answer within 3 s: pass --tokenizer_cache_dir DIR"):
        q.find_tokenizer_dir(str(tmp_path), None)
    assert time.monotonic() - start < 10 and no_download == []


def test_any_http_answer_counts_as_reachable(monkeypatch):
    import urllib.request

    def answer(request, timeout=None):
        assert request.get_method() == "HEAD" and timeout == q.HUB_CONNECT_TIMEOUT
        raise urllib.error.HTTPError(request.full_url, 404, "Not Found", {}, None)

    monkeypatch.setattr(urllib.request, "urlopen", answer)
    assert q.reachable("https://huggingface.co")


def test_a_reachable_hub_downloads_only_the_tokenizer(tiny_snapshot, tmp_path, online, monkeypatch):
    import huggingface_hub

    asked: list = []

    def fake_download(repo_id, **kwargs):  # the hub client's call, answered from the tiny snapshot
        asked.append((repo_id, kwargs))
        return str(hub_cache_with_tokenizer(Path(kwargs["cache_dir"]), tiny_snapshot / "tokenizer").parent)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setattr(q, "reachable", lambda url, timeout=q.HUB_CONNECT_TIMEOUT: True)
    monkeypatch.setenv("HF_ENDPOINT", UNROUTABLE)
    tok = q.load_tokenizer(str(tmp_path / "cache"), None)
    assert len(q.tokenize(tok, "a red square")) > 0
    [(repo, kwargs)] = asked
    assert repo == q.TOKENIZER_REPO and kwargs["allow_patterns"] == ["tokenizer/*"]
    assert kwargs["endpoint"] == UNROUTABLE and kwargs["etag_timeout"] <= 5
    assert q.find_tokenizer_dir(str(tmp_path / "cache"), None).is_dir()  # now cached: found with no call
    assert len(asked) == 1


def test_a_failed_download_is_one_sentence(tmp_path, online, monkeypatch):
    import huggingface_hub

    def broken(repo_id, **kwargs):
        raise ConnectionError("Connection reset by peer\nmore lines")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", broken)
    monkeypatch.setattr(q, "reachable", lambda url, timeout=q.HUB_CONNECT_TIMEOUT: True)
    with pytest.raises(UserError, match=r"Could not download .*\(ConnectionError: Connection reset by peer\): pass"):
        q.find_tokenizer_dir(str(tmp_path), None)
