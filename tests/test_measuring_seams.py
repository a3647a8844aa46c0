"""The product's two seams for benchmarks: the trainer's step hook and the last run's phase timings."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from library.runtime.phase_timer import last_run_timings, set_last_run_timings
from library.training.network_trainer import NetworkTrainer
from tests.test_trainer import base_args, make_toy_dataset, train


def test_step_hook_wraps_every_batch_until_removed(tiny_snapshot, tmp_path):
    data = make_toy_dataset(tmp_path / "data", n=2)
    events: list[str] = []

    @contextlib.contextmanager
    def hook() -> Iterator[None]:
        events.append("enter")
        yield
        events.append("exit")

    remove = NetworkTrainer.add_step_hook(hook)
    try:  # 2 optimizer steps of 2 accumulated batches each: the hook sees every batch
        run = train(base_args(tiny_snapshot, data, tmp_path / "a", "--max_train_steps", "2",
                              "--gradient_accumulation_steps", "2"))
    finally:
        remove()
    assert run.global_step == 2
    assert events == ["enter", "exit"] * 4
    train(base_args(tiny_snapshot, data, tmp_path / "b", "--max_train_steps", "1"))
    assert len(events) == 8  # removed: the next run does not call it


def test_last_run_timings_is_a_copy_of_the_recorded_ones():
    set_last_run_timings({"encode": 1.5, "denoise": 2.0})
    got = last_run_timings()
    got["encode"] = 0.0
    assert last_run_timings() == {"encode": 1.5, "denoise": 2.0}
    set_last_run_timings({})
    assert last_run_timings() == {}
