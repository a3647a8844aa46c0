"""Shared fixtures: the tiny MOSS-Image snapshot (built once per test session, in the official layouts), and the
small-scale end-to-end bench run of tests/test_full_e2e.py, started in the background at the session's first test.

The end-to-end run is a chain of product commands, each in its own single-threaded process, and the rest of the
suite runs single-threaded too: on a 2-core machine the two share the cores instead of queueing. Its tests are
moved to the end of the session, where they read the finished run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads only fight each other on a 2-core machine

REPO = Path(__file__).resolve().parent.parent
E2E_TESTS = "test_full_e2e.py"
E2E_FIXTURE = "e2e"
E2E_TIMEOUT_S = 1800
E2E_OPTIONS = ("snapshot,data,cache,train,infer,quality,ddp,report", "--scale", "small",
               "--configs", "bf16_gc,int8_swap20,int8_te_lora", "--runs", "bf16,int8_compile",
               "--profile", "bf16_gc", "--profile_call", "2")


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The end-to-end tests last (a stable sort keeps every other order): they wait for the background run."""
    items.sort(key=lambda item: item.path.name == E2E_TESTS)


@pytest.fixture(scope="session", autouse=True)
def _model_hash_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The base-model hash cache of the runs lives in the session's temp folder, never in the user's cache."""
    os.environ["MOSS_IMAGE_SCRIPTS_CACHE"] = str(tmp_path_factory.mktemp("model_hash_cache"))


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from library.moss_image.tiny_snapshot import build_tiny_snapshot

    return build_tiny_snapshot(tmp_path_factory.mktemp("snapshot") / "moss-image-tiny")


@dataclass
class BackgroundE2E:
    """`python -m bench.full_e2e` at --scale small in its own process group, its log in `out/e2e.log`."""

    root: Path
    out: Path
    proc: subprocess.Popen

    @classmethod
    def start(cls, tmp_path_factory: pytest.TempPathFactory) -> BackgroundE2E:
        root, out = tmp_path_factory.mktemp("e2e"), tmp_path_factory.mktemp("e2e_out")
        cmd = [sys.executable, "-m", "bench.full_e2e", *E2E_OPTIONS, "--root", str(root), "--out", str(out)]
        with open(out / "e2e.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(root, out, proc)

    def wait(self) -> int:
        """The run's exit status (the log's tail is printed when it failed)."""
        try:
            code = self.proc.wait(timeout=E2E_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if code != 0:
            print("\n".join((self.out / "e2e.log").read_text().splitlines()[-40:]))
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:  # e.g. the session stopped early (-x): end the run and the runs it started
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()


@pytest.fixture(scope="session", autouse=True)
def e2e_background(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _model_hash_cache: None
                   ) -> Iterator[BackgroundE2E | None]:
    """Starts the end-to-end run at the first test when a selected test reads it (the `e2e` fixture); its processes
    inherit the session's environment (the hash cache folder above)."""
    if not any(E2E_FIXTURE in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    run = BackgroundE2E.start(tmp_path_factory)
    yield run
    run.stop()


def count_dit_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> dict[str, int]:
    """Counts the calls of `library.moss_image.dit.<name>` (a function the module imported) from here on."""
    from library.moss_image import dit

    calls = {"n": 0}
    original = getattr(dit, name)

    def counting(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(dit, name, counting)
    return calls


@pytest.fixture
def stacked_forward_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the DiT's stacked q/k/v products (`library.moss_image.dit.stacked_forward`, which compiled blocks
    inline, so the count is of traces there and of calls in eager code)."""
    return count_dit_calls(monkeypatch, "stacked_forward")


@pytest.fixture
def packed_passes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the DiT's packed passes (`cfg_packing.packed_forward`, as `MossImage.forward_packed` calls it)."""
    return count_dit_calls(monkeypatch, "packed_forward")
