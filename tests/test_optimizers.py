import argparse
import importlib.util
import math
import sys
import types

import pytest
import torch

from library.training import optimizers as opt
from library.training import lr_schedulers as sch
from library.errors import UserError


def make_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    opt.add_optimizer_arguments(parser)
    return parser.parse_args(list(argv))


def ocfg(*argv: str) -> opt.OptimizerConfig:
    return opt.OptimizerConfig.from_args(make_args(*argv))


def scfg(*argv: str) -> sch.SchedulerConfig:
    return sch.SchedulerConfig.from_args(make_args(*argv))


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def train_steps(model: torch.nn.Module, optimizer, steps: int = 3) -> list[float]:
    torch.manual_seed(123)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def test_defaults_match_sd_scripts():
    a = make_args()
    assert a.optimizer_type == "" and a.optimizer_args is None
    assert a.learning_rate == 2e-6 and a.max_grad_norm == 1.0
    assert a.lr_scheduler == "constant" and a.lr_warmup_steps == 0 and a.lr_decay_steps == 0
    assert a.lr_scheduler_num_cycles == 1 and a.lr_scheduler_power == 1
    assert a.lr_scheduler_timescale is None and a.lr_scheduler_min_lr_ratio is None
    assert a.lr_scheduler_type == "" and a.lr_scheduler_args is None
    assert not (a.use_8bit_adam or a.use_lion_optimizer or a.fused_backward_pass)


def test_step_count_forms():
    assert opt.parse_step_count("100") == 100 and isinstance(opt.parse_step_count("100"), int)
    assert opt.parse_step_count("0.1") == 0.1
    assert opt.parse_step_count("10%") == pytest.approx(0.1)
    assert opt.parse_step_count("3.0") == 3
    for bad in ("abc", "-1", "2.5", "150%"):
        with pytest.raises(argparse.ArgumentTypeError):
            opt.parse_step_count(bad)
    assert make_args("--lr_warmup_steps", "5%").lr_warmup_steps == pytest.approx(0.05)
    with pytest.raises(SystemExit):
        make_args("--lr_warmup_steps", "x")
    # ratios are shares of the run; integers are optimizer steps (x num_processes ticks)
    assert sch.resolve_step_count(0.1, 200, 2, "--lr_warmup_steps") == 20
    assert sch.resolve_step_count(1.0, 200, 2, "--lr_warmup_steps") == 200  # 100%
    assert sch.resolve_step_count(10, 200, 2, "--lr_warmup_steps") == 20
    assert sch.resolve_step_count("10%", 200, 1, "--lr_warmup_steps") == 20


def test_optimizer_args_are_python_literals():
    kw = opt.parse_kwargs_args(["weight_decay=0.01", "betas=0.9,0.999", "decouple=True", "step_rules=1:10,0.1"], "x")
    assert kw == {"weight_decay": 0.01, "betas": (0.9, 0.999), "decouple": True, "step_rules": "1:10,0.1"}
    with pytest.raises(UserError):
        opt.parse_kwargs_args(["weight_decay"], "--optimizer_args")


def test_adamw_default_name_description_and_groups():
    model = tiny_model()
    groups = [
        {"params": list(model[0].parameters()), "lr": 1e-3},
        {"params": list(model[2].parameters()), "lr": 5e-4},
    ]
    args = ocfg("--learning_rate", "1e-3", "--optimizer_args", "weight_decay=0.05", "betas=0.9,0.95")
    name, desc, optimizer = opt.get_optimizer(args, groups)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert name == "torch.optim.adamw.AdamW"
    assert desc == "weight_decay=0.05,betas=(0.9, 0.95)"
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 5e-4]
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    losses = train_steps(model, optimizer, 5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("optimizer_type", ["SGDNesterov", "Lion", "RAdam", "torch.optim.Adagrad"])
def test_builtin_optimizers_step(optimizer_type):
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    name, _, optimizer = opt.get_optimizer(
        ocfg("--optimizer_type", optimizer_type, "--learning_rate", "1e-3"), model.parameters()
    )
    losses = train_steps(model, optimizer, 4)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert losses[-1] < losses[0]
    if optimizer_type == "SGDNesterov":
        assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.9
    if optimizer_type == "Lion":
        assert name == "library.training.optimizers.Lion"


def test_lion_update_matches_the_formula():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    lion = opt.Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    g1 = torch.tensor([0.3, -0.1, 0.0])
    p.grad = g1.clone()
    lion.step()
    # m = 0: update = sign(0.1 * g); p = p * (1 - 0.1 * 0.5) - 0.1 * sign(g)
    expected = torch.tensor([1.0, -2.0, 0.5]) * 0.95 - 0.1 * torch.sign(g1)
    assert torch.allclose(p.detach(), expected)
    m = 0.01 * g1
    g2 = torch.tensor([-1.0, -1.0, 1.0])
    p.grad = g2.clone()
    lion.step()
    expected = expected * 0.95 - 0.1 * torch.sign(0.9 * m + 0.1 * g2)
    assert torch.allclose(p.detach(), expected)
    assert torch.allclose(lion.state[p]["exp_avg"], 0.99 * m + 0.01 * g2)
    # bf16 parameters step through a float32 copy
    q = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    lion16 = opt.Lion([q], lr=0.125)
    q.grad = torch.ones(4, dtype=torch.bfloat16)
    lion16.step()
    assert torch.equal(q.detach(), torch.full((4,), 0.875, dtype=torch.bfloat16))


def test_legacy_flags():
    assert ocfg().optimizer_type == "AdamW"
    assert ocfg("--use_8bit_adam").optimizer_type == "AdamW8bit"
    assert ocfg("--use_lion_optimizer").optimizer_type == "Lion"
    assert opt.resolve_optimizer_type("", False, True) == "Lion"
    for argv in (["--use_8bit_adam", "--use_lion_optimizer"], ["--use_lion_optimizer", "--optimizer_type", "AdamW"]):
        with pytest.raises(UserError):
            ocfg(*argv)


def _bnb_usable() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _bnb_usable(), reason="bitsandbytes cannot be loaded here")
@pytest.mark.parametrize("optimizer_type", ["AdamW8bit", "Lion8bit", "SGDNesterov8bit"])
def test_bitsandbytes_optimizers_step(optimizer_type):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 96)  # > 4096 elements: the 8-bit state path
    before = model.weight.detach().clone()
    name, _, optimizer = opt.get_optimizer(
        ocfg("--optimizer_type", optimizer_type, "--learning_rate", "1e-3"), model.parameters()
    )
    assert name.startswith("bitsandbytes.")
    x = torch.randn(8, 64)
    model(x).square().mean().backward()
    optimizer.step()
    assert not torch.equal(before, model.weight.detach())


def test_bitsandbytes_errors(monkeypatch):
    if not torch.cuda.is_available() and _bnb_usable():
        with pytest.raises(UserError, match="CUDA"):
            opt.get_optimizer(ocfg("--optimizer_type", "PagedAdamW8bit"), tiny_model().parameters())
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(UserError, match="pip install bitsandbytes"):
        opt.get_optimizer(ocfg("--optimizer_type", "AdamW8bit"), tiny_model().parameters())


@pytest.mark.parametrize(
    "optimizer_type,package",
    [("Prodigy", "prodigyopt"), ("DAdaptAdam", "dadaptation"), ("DAdaptation", "dadaptation"),
     ("AdamWScheduleFree", "schedulefree")],
)
def test_optional_packages_named_when_missing(optimizer_type, package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(UserError, match=f"pip install {package}"):
        opt.get_optimizer(ocfg("--optimizer_type", optimizer_type), tiny_model().parameters())


def test_unknown_optimizer_class():
    with pytest.raises(UserError):
        opt.get_optimizer(ocfg("--optimizer_type", "NoSuchOptimizer"), tiny_model().parameters())
    with pytest.raises(UserError):
        opt.get_optimizer(ocfg("--optimizer_type", "nosuchpkg.mod.Opt"), tiny_model().parameters())
    with pytest.raises(UserError, match="optimizer_args"):
        opt.get_optimizer(ocfg("--optimizer_args", "nonsense_arg=1"), tiny_model().parameters())


class _FakeScheduleFree(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, **kw):
        super().__init__(params, lr=lr, **kw)
        self.mode = "eval"

    def train(self):
        self.mode = "train"

    def eval(self):
        self.mode = "eval"


def test_schedulefree_wiring_with_a_stand_in_package(monkeypatch):
    fake = types.ModuleType("schedulefree")
    _FakeScheduleFree.__module__ = "schedulefree"
    fake.AdamWScheduleFree = _FakeScheduleFree
    monkeypatch.setitem(sys.modules, "schedulefree", fake)
    model = tiny_model()
    args = make_args("--optimizer_type", "AdamWScheduleFree", "--learning_rate", "1e-3")
    name, _, optimizer = opt.get_optimizer(opt.OptimizerConfig.from_args(args), model.parameters())
    assert name == "schedulefree._FakeScheduleFree" and opt.is_schedulefree_optimizer(optimizer)
    train_fn, eval_fn = opt.get_optimizer_train_eval_fn(optimizer)
    train_fn()
    assert optimizer.mode == "train"
    eval_fn()
    assert optimizer.mode == "eval"
    sched = sch.get_scheduler(sch.SchedulerConfig.from_args(args), optimizer, max_train_steps=10)
    assert sched.lr_lambdas[0](5) == 1.0
    with pytest.raises(UserError, match="schedule-free"):
        sch.get_scheduler(scfg("--lr_scheduler", "cosine"), optimizer, max_train_steps=10)
    # other optimizers: no-op functions
    _, _, adamw = opt.get_optimizer(ocfg(), model.parameters())
    assert not opt.is_schedulefree_optimizer(adamw)
    assert opt.get_optimizer_train_eval_fn(adamw)[0]() is None


def test_prodigy_wiring_with_a_stand_in_package(monkeypatch, caplog):
    fake = types.ModuleType("prodigyopt")
    fake.Prodigy = torch.optim.Adam
    monkeypatch.setitem(sys.modules, "prodigyopt", fake)
    _, _, optimizer = opt.get_optimizer(ocfg("--optimizer_type", "prodigy", "--learning_rate", "0.01"),
                                        tiny_model().parameters())
    assert isinstance(optimizer, torch.optim.Adam)
    assert "around 1.0" in caplog.text


def test_adafactor_relative_step_and_its_scheduler():
    model = tiny_model()
    groups = [{"params": list(model.parameters()), "lr": 1e-3}]
    args = make_args("--optimizer_type", "AdaFactor", "--learning_rate", "1e-3", "--lr_scheduler", "cosine")
    name, desc, optimizer = opt.get_optimizer(opt.OptimizerConfig.from_args(args), groups)
    assert name == "transformers.optimization.Adafactor"
    assert desc == "relative_step=True"
    assert optimizer.defaults["relative_step"] and optimizer.param_groups[0]["lr"] is None
    sched = sch.get_scheduler(sch.SchedulerConfig.from_args(args), optimizer, max_train_steps=20)  # cosine replaced
    assert type(sched).__name__ == "AdafactorSchedule"
    assert sched.get_last_lr() == [1e-3]
    losses = train_steps(model, optimizer, 4)
    assert losses[-1] < losses[0]
    with pytest.raises(UserError):
        sch.get_scheduler(scfg("--lr_warmup_steps", "5", "--lr_scheduler", "adafactor"), optimizer, max_train_steps=20)
    # relative_step=False keeps --learning_rate and the chosen scheduler; the adafactor scheduler is refused
    args2 = make_args("--optimizer_type", "Adafactor", "--learning_rate", "1e-3", "--optimizer_args",
                      "relative_step=False", "scale_parameter=False", "warmup_init=False",
                      "--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "2")
    _, _, optimizer2 = opt.get_optimizer(opt.OptimizerConfig.from_args(args2), tiny_model().parameters())
    assert optimizer2.param_groups[0]["lr"] == 1e-3
    sched2 = sch.get_scheduler(sch.SchedulerConfig.from_args(args2), optimizer2, max_train_steps=20)
    assert sched2.lr_lambdas[0](1) == 0.5
    with pytest.raises(UserError, match="relative_step"):
        sch.get_scheduler(scfg("--lr_scheduler", "adafactor"), optimizer2, max_train_steps=20)


def _fused_vs_plain(max_grad_norm: float) -> None:
    args = ocfg("--optimizer_type", "Adafactor", "--fused_backward_pass", "--max_grad_norm", str(max_grad_norm))
    plain_model, fused_model = tiny_model(3), tiny_model(3)
    _, _, plain = opt.get_optimizer(args, plain_model.parameters())
    _, _, fused = opt.get_optimizer(args, fused_model.parameters())
    opt.check_fused_backward_pass(args, fused, gradient_accumulation_steps=1)
    handles = opt.install_fused_backward_pass(fused, max_grad_norm)
    torch.manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        torch.nn.functional.mse_loss(plain_model(x), y).backward()
        if max_grad_norm:
            for p in plain_model.parameters():  # fused clipping is per parameter
                torch.nn.utils.clip_grad_norm_(p, max_grad_norm)
        plain.step()
        plain.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(fused_model(x), y).backward()
        assert all(p.grad is None for p in fused_model.parameters())
    for a, b in zip(plain_model.parameters(), fused_model.parameters()):
        assert torch.allclose(a, b, atol=1e-7)
    for h in handles:
        h.remove()


def test_fused_backward_pass_matches_plain_adafactor():
    _fused_vs_plain(0.0)
    _fused_vs_plain(0.01)


def test_fused_backward_pass_checks():
    _, _, adamw = opt.get_optimizer(ocfg(), tiny_model().parameters())
    with pytest.raises(UserError, match="Adafactor only"):
        opt.check_fused_backward_pass(ocfg("--fused_backward_pass"), adamw, gradient_accumulation_steps=1)
    with pytest.raises(UserError):
        opt.verify_optimizer_arguments(ocfg("--fused_backward_pass"), gradient_accumulation_steps=1)
    with pytest.raises(UserError, match="gradient_accumulation"):
        opt.verify_optimizer_arguments(
            ocfg("--fused_backward_pass", "--optimizer_type", "Adafactor"), gradient_accumulation_steps=4
        )
    opt.verify_optimizer_arguments(ocfg("--fused_backward_pass", "--optimizer_type", "Adafactor"),
                                   gradient_accumulation_steps=1)


def sched_for(*argv: str, steps: int = 100, num_processes: int = 1, lr: float = 1.0):
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=lr)
    return sch.get_scheduler(scfg(*argv), optimizer, num_processes=num_processes, max_train_steps=steps), optimizer


def lrs(*argv: str, at: tuple[int, ...], **kw) -> list[float]:
    sched, _ = sched_for(*argv, **kw)
    return [sched.lr_lambdas[0](s) for s in at]


def test_schedule_shapes_against_hand_values():
    approx = pytest.approx
    assert lrs("--lr_scheduler", "constant", at=(0, 50, 100)) == [1.0, 1.0, 1.0]
    assert lrs("--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "10", at=(0, 5, 10, 90)) == approx(
        [0.0, 0.5, 1.0, 1.0]
    )
    assert lrs("--lr_scheduler", "linear", "--lr_warmup_steps", "10", at=(0, 5, 10, 55, 100)) == approx(
        [0.0, 0.5, 1.0, 0.5, 0.0]
    )
    assert lrs("--lr_scheduler", "cosine", "--lr_warmup_steps", "10", at=(5, 10, 55, 100)) == approx(
        [0.5, 1.0, 0.5, 0.0], abs=1e-12
    )
    assert lrs("--lr_scheduler", "cosine_with_restarts", "--lr_scheduler_num_cycles", "2",
               at=(0, 25, 50, 75, 100)) == approx([1.0, 0.5, 1.0, 0.5, 0.0], abs=1e-12)
    assert lrs("--lr_scheduler", "polynomial", "--lr_scheduler_power", "2", at=(0, 50, 100, 150), lr=1e-3) == approx(
        [1.0, ((1e-3 - 1e-7) * 0.25 + 1e-7) / 1e-3, 1e-4, 1e-4]
    )
    assert lrs("--lr_scheduler", "inverse_sqrt", "--lr_warmup_steps", "10", at=(5, 10, 40)) == approx(
        [0.5, 1.0, 0.5]
    )
    assert lrs("--lr_scheduler", "inverse_sqrt", "--lr_scheduler_timescale", "20", at=(0, 60)) == approx(
        [1.0, 0.5]
    )
    assert lrs("--lr_scheduler", "cosine_with_min_lr", "--lr_scheduler_min_lr_ratio", "0.1",
               at=(0, 50, 100)) == approx([1.0, 0.55, 0.1])
    assert lrs("--lr_scheduler", "warmup_stable_decay", "--lr_warmup_steps", "10", "--lr_decay_steps", "20",
               at=(5, 10, 50, 79, 80, 90, 100)) == approx([0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0], abs=1e-12)
    assert lrs("--lr_scheduler", "warmup_stable_decay", "--lr_warmup_steps", "10", "--lr_decay_steps", "0.2",
               "--lr_scheduler_min_lr_ratio", "0.1", at=(0, 90, 100)) == approx([0.1, 0.55, 0.1])
    assert lrs("--lr_scheduler", "piecewise_constant", "--lr_scheduler_args", "step_rules=1:10,0.1:20,0.01",
               at=(0, 9, 10, 19, 20, 500)) == approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_schedule_length_and_warmup_scale_with_processes():
    # 50 optimizer steps on 2 processes = 100 scheduler ticks; 10% warmup = 10 ticks; 5 warmup steps = 10 ticks
    for warmup in ("10%", "5"):
        assert lrs("--lr_scheduler", "linear", "--lr_warmup_steps", warmup, steps=50, num_processes=2,
                   at=(5, 10, 55, 100)) == pytest.approx([0.5, 1.0, 0.5, 0.0])


def test_scheduler_steps_the_optimizer_lr():
    sched, optimizer = sched_for("--lr_scheduler", "linear", steps=4, lr=0.8)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    assert seen == pytest.approx([0.8, 0.6, 0.4, 0.2])
    assert sch.get_scheduler(scfg(), optimizer, max_train_steps=4).state_dict()["last_epoch"] == 0


def test_custom_scheduler_class():
    sched, optimizer = sched_for("--lr_scheduler_type", "StepLR", "--lr_scheduler_args", "step_size=2", "gamma=0.5")
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    sched2, _ = sched_for("--lr_scheduler_type", "torch.optim.lr_scheduler.ExponentialLR",
                          "--lr_scheduler_args", "gamma=0.9")
    assert isinstance(sched2, torch.optim.lr_scheduler.ExponentialLR)
    with pytest.raises(UserError):
        sched_for("--lr_scheduler_type", "StepLR")  # step_size missing
    with pytest.raises(UserError):
        sched_for("--lr_scheduler_type", "NoSuchLR")


def test_scheduler_errors():
    cases = [
        ("--lr_scheduler", "constant", "--lr_warmup_steps", "10"),
        ("--lr_scheduler", "bogus"),
        ("--lr_scheduler_args", "not_key_value"),
        ("--lr_scheduler", "cosine_with_min_lr"),
        ("--lr_scheduler", "piecewise_constant"),
        ("--lr_scheduler", "piecewise_constant", "--lr_scheduler_args", "step_rules=oops"),
        ("--lr_scheduler", "warmup_stable_decay", "--lr_warmup_steps", "60", "--lr_decay_steps", "60"),
        ("--lr_scheduler", "linear", "--lr_warmup_steps", "500"),
        ("--lr_scheduler", "linear", "--lr_scheduler_args", "nonsense=1"),
        ("--lr_scheduler", "polynomial", "--lr_scheduler_args", "lr_end=2.0"),
    ]
    for argv in cases:
        with pytest.raises(UserError):
            sched_for(*argv)
    with pytest.raises(UserError, match="training steps"):
        sch.get_scheduler(scfg("--lr_scheduler", "cosine"), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))],
                                                                             lr=1.0))
    with pytest.raises(UserError):
        sch.verify_scheduler_arguments(scfg("--lr_scheduler", "bogus"))
    with pytest.raises(UserError, match="key=value"):
        ocfg("--optimizer_args", "weight_decay")  # parsed with the options, before any model is loaded


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers missing")
def test_schedules_agree_with_transformers():
    from transformers import optimization as tro

    p = torch.nn.Parameter(torch.zeros(1))
    checks = [
        (tro.get_linear_schedule_with_warmup, dict(num_warmup_steps=7, num_training_steps=50), ("linear",)),
        (tro.get_cosine_schedule_with_warmup, dict(num_warmup_steps=7, num_training_steps=50), ("cosine",)),
        (tro.get_cosine_with_hard_restarts_schedule_with_warmup,
         dict(num_warmup_steps=7, num_training_steps=50, num_cycles=3),
         ("cosine_with_restarts", "--lr_scheduler_num_cycles", "3")),
        (tro.get_polynomial_decay_schedule_with_warmup,
         dict(num_warmup_steps=7, num_training_steps=50, power=2.0),
         ("polynomial", "--lr_scheduler_power", "2")),
    ]
    for fn, kw, argv in checks:
        ref = fn(torch.optim.SGD([p], lr=0.5), **kw)
        sched, _ = sched_for("--lr_scheduler", *argv, "--lr_warmup_steps", "7", steps=50, lr=0.5)
        for step in (0, 3, 7, 20, 33, 49, 50):
            assert sched.lr_lambdas[0](step) == pytest.approx(ref.lr_lambdas[0](step), abs=1e-12), (argv, step)
    assert math.isclose(lrs("--lr_scheduler", "linear", at=(0,))[0], 1.0)


@pytest.mark.skipif(not (torch.cuda.is_available() and _bnb_usable()), reason="needs CUDA and bitsandbytes")
@pytest.mark.parametrize("optimizer_type", ["AdamW8bit", "PagedAdamW8bit"])
def test_bitsandbytes_optimizers_on_cuda_follow_adamw(optimizer_type):
    """As in the trainer: the optimizer is made while the LoRA is on the CPU, and the LoRA is moved to the GPU before
    the first step (its parameters keep their identity); the 8-bit state then lives on the GPU (a paged optimizer's
    in CUDA managed memory, which torch sees as CPU tensors marked `is_paged`)."""
    torch.manual_seed(0)
    # 512 x 256 weights: above 4096 elements (the 8-bit state path) and above 1e5 (bitsandbytes pages only the
    # states of tensors that large; smaller ones get plain device tensors even from a paged optimizer)
    ref = torch.nn.Linear(512, 256)
    model = torch.nn.Linear(512, 256)
    model.load_state_dict(ref.state_dict())
    start = model.weight.detach().clone().cuda()
    _, _, optimizer = opt.get_optimizer(ocfg("--optimizer_type", optimizer_type, "--learning_rate", "1e-3"),
                                        model.parameters())
    _, _, adamw = opt.get_optimizer(ocfg("--optimizer_type", "AdamW", "--learning_rate", "1e-3"), ref.parameters())
    model.cuda()
    ref.cuda()
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(1)).cuda()
    for _ in range(3):
        for m, o in ((model, optimizer), (ref, adamw)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    state = {k: t for k, t in optimizer.state[model.weight].items() if isinstance(t, torch.Tensor) and t.numel() > 1}
    assert state["state1"].dtype == torch.uint8
    assert getattr(state["state1"], "is_paged", False) == optimizer_type.startswith("Paged")
    assert all(t.device.type == "cuda" or getattr(t, "is_paged", False) for t in state.values())
    ours, theirs = model.weight.detach() - start, ref.weight.detach() - start
    assert torch.isfinite(ours).all() and ours.abs().max() > 0
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.95
