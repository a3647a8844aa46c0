"""bench/plain_reference.py --tiny: the plain PyTorch reference stack runs every checkpointing configuration on the
CPU, writes its JSON, and its checkpointing configurations train exactly like the one without (fp32)."""

from __future__ import annotations

import json
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import plain_reference as bench


def test_tiny_plain_reference_runs_and_checkpointing_keeps_the_losses(tmp_path):
    out = tmp_path / "plain.json"
    names = ["none", "selective", "full", "selective_attn"]
    assert bench.main(["--tiny", "--configs", ",".join(names), "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["device"] == "cpu" and payload["num_layers"] == 2 and payload["backend"] == "eager"
    assert payload["command"].endswith("--out " + str(out))
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == names
    for r in results.values():
        assert r["ok"] and len(r["step_ms"]) == 2 and r["step_ms_median"] > 0 and r["lora_params"] > 0
        assert len(r["losses"]) == 3 and all(math.isfinite(v) and v > 0 for v in r["losses"])
    # AdamW moves the LoRA weights: the loss changes from step to step
    assert len(set(results["none"]["losses"])) == 3
    # recomputing in backward (all of the block, or all but the saved products) changes nothing in fp32
    ref = results["none"]["losses"]
    for name in names[1:]:
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(results[name]["losses"], ref)), name
    assert results["selective"]["max_rel_loss_diff"] < 1e-6


def test_unknown_configuration_is_refused(tmp_path, capsys):
    assert bench.main(["--tiny", "--configs", "none,everything", "--out", str(tmp_path / "x.json")]) == 2
    assert "choose from" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def _backward_ops(checkpointing: str) -> tuple[int, float]:
    """aten operators that one block's backward dispatches (the recomputation included), and a LoRA gradient."""
    shape = bench.make_shape(True, 2, None, None)
    torch.manual_seed(0)
    block = bench.Block(shape.cfg, shape.rank, torch.float32, checkpointing)
    x = torch.randn(1, shape.text_tokens + shape.grid**2, shape.cfg.hidden_size, requires_grad=True)
    mod = torch.randn(1, 6, shape.cfg.hidden_size)
    y = block(x, mod, *bench.rope_tables(shape, torch.device("cpu")))
    with _CountOps() as count:
        y.square().mean().backward()
    return count.n, float(block.q.down.weight.grad.abs().sum())


class _CountOps(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_checkpointing_configurations_recompute_what_they_do_not_keep():
    ops = {name: _backward_ops(name) for name in bench.CONFIGS}
    # the same gradient, with the more recomputation the less a configuration keeps
    assert len({grad for _, grad in ops.values()}) == 1 and ops["none"][1] > 0
    assert ops["none"][0] < ops["selective"][0] < ops["selective_attn"][0] < ops["full"][0], ops
