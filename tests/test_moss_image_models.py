"""The reconstructed DiT: published sizes, forward semantics, masking, skip layers, checkpointing modes."""

import dataclasses

import pytest
import torch

from library.moss_image.dit import MossImage, MossImageConfig, count_parameters, default_rope_axes
from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG, tiny_dit_state_dict

FULL_TOTAL = 5_083_020_416
FULL_BLOCK_LINEAR_WEIGHTS = 4_756_340_736  # = 42 * (4 * 3072^2 + 3 * 3072 * 8192)


def test_full_size_totals_on_meta():
    cfg = MossImageConfig()
    total, block_linears = count_parameters(cfg)
    assert block_linears == FULL_BLOCK_LINEAR_WEIGHTS == cfg.block_linear_weights
    assert total == FULL_TOTAL
    assert 5.0e9 <= total <= 5.2e9
    assert total * 2 / 1e9 == pytest.approx(10.17, abs=0.01)  # bf16 size in GB (seed 002)
    with torch.device("meta"):
        model = MossImage(cfg)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")]
    assert len(linears) == 252
    assert {n.split(".", 2)[2] for n in linears} == {
        "proj.q", "proj.k", "proj.v", "proj.o", "proj.ffn_up_gate", "proj.ffn_down"
    }


def test_rope_axes_default():
    assert default_rope_axes(128) == (32, 48, 48)
    assert sum(default_rope_axes(16)) == 16


def test_config_update_from_json_fields():
    cfg = MossImageConfig().updated({"rope_theta": 256.0, "num_attention_heads": 24, "foo": 1})
    assert cfg.rope_theta == 256.0 and cfg.extra == {"foo": 1}
    with pytest.raises(ValueError):
        dataclasses.replace(MossImageConfig(), head_dim=64)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = MossImage(TINY_DIT_CONFIG)
    model.load_state_dict({k: v.float() for k, v in tiny_dit_state_dict(0).items()})
    return model.eval()


def _inputs(b=2, t=7, h=3, w=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 128, h, w, generator=g)
    emb = torch.randn(b, t, TINY_DIT_CONFIG.text_dim, generator=g)
    ts = torch.tensor([999.0, 120.0][:b])
    return x, ts, emb


def test_forward_shape_and_dtype(tiny):
    x, ts, emb = _inputs()
    out = tiny(x, ts, emb, torch.ones(2, 7, dtype=torch.bool))
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_padding_is_invisible(tiny):
    """A padded caption gives the same image output as the same caption alone (mask + RoPE offsets by valid length)."""
    x, ts, emb = _inputs(b=1, t=5)
    alone = tiny(x, ts[:1], emb, torch.ones(1, 5, dtype=torch.bool))
    padded_emb = torch.cat([emb, torch.randn(1, 3, emb.shape[-1])], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    padded = tiny(x, ts[:1], padded_emb, mask)
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_split_attn_matches_masked(tiny):
    x, ts, emb = _inputs()
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    ref = tiny(x, ts, emb, mask)
    split = MossImage(TINY_DIT_CONFIG, split_attn=True)
    split.load_state_dict(tiny.state_dict())
    torch.testing.assert_close(split(x, ts, emb, mask), ref, atol=1e-5, rtol=1e-5)


def test_skip_layers(tiny, monkeypatch):
    x, ts, emb = _inputs()
    base = tiny(x, ts, emb)
    skipped = tiny(x, ts, emb, skip_layers=[22])
    assert not torch.allclose(base, skipped)
    # skipping block 22 == running the stack with block 22 replaced by the identity
    monkeypatch.setattr(tiny.layers[22], "forward", lambda seq, *args: seq)
    torch.testing.assert_close(tiny(x, ts, emb), skipped)


def test_timestep_changes_output(tiny):
    x, _, emb = _inputs()
    a = tiny(x, torch.tensor([100.0, 100.0]), emb)
    b = tiny(x, torch.tensor([900.0, 900.0]), emb)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["plain", "cpu_offload", "unsloth"])
def test_checkpointing_modes_same_grads(tiny, mode):
    x, ts, emb = _inputs()
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])

    def run(model):
        model.zero_grad()
        model.requires_grad_(False)
        for blk in (model.layers[0], model.layers[5]):
            blk.proj.q.weight.requires_grad_(True)
        inp = x.clone().requires_grad_(True)
        out = model(inp, ts, emb, mask)
        out.square().mean().backward()
        return out.detach(), inp.grad, model.layers[0].proj.q.weight.grad, model.layers[5].proj.q.weight.grad

    ref = run(tiny)
    other = MossImage(TINY_DIT_CONFIG)
    other.load_state_dict(tiny.state_dict())
    other.train()
    other.enable_gradient_checkpointing(cpu_offload=mode == "cpu_offload", unsloth_offload=mode == "unsloth")
    got = run(other)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_activations_follow_float_weights_not_int8():
    """Seed 004's bug: activations were cast to the q weight's dtype (int8 under ConvRot)."""
    model = MossImage(TINY_DIT_CONFIG).to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    model.layers[0].proj.q.weight.data = model.layers[0].proj.q.weight.data.to(torch.float32)
    assert model.dtype == torch.bfloat16  # read from a never-quantised weight
