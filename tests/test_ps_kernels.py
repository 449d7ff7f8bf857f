"""The servers' optimizer kernel: fused where the user left it open, same arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridagg.ps.compensation import Compensation
from hybridagg.ps.kernels import build_optimizer, one_pass_settings
from hybridagg.ps.spec import ServerSpec
from hybridagg.ps.store import ShardStore


def _settings(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize(
    ("given", "fused"),
    [
        ({"fused": None, "foreach": None}, True),
        ({"fused": False, "foreach": None}, False),  # the user said no
        ({"fused": None, "foreach": True}, None),  # the user chose foreach
        ({"fused": None, "foreach": False}, None),  # the user chose the loop
        ({"fused": None, "foreach": None, "differentiable": True}, None),
    ],
)
def test_one_pass_settings_only_fills_an_open_choice(given, fused):
    out = one_pass_settings(given)
    assert out["fused"] is fused
    assert given["fused"] in (None, False)  # the input is not changed
    assert one_pass_settings({"lr": 0.1, "foreach": None}) == {
        "lr": 0.1,
        "foreach": None,
    }  # a class without a fused kernel (RMSprop's defaults) is left alone


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    ],
    ids=["sgd", "adam", "rmsprop"],
)
def test_build_optimizer_steps_as_the_users_optimizer(make):
    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(n)) for n in (300, 17)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    user = make(theirs)
    groups = [{**s, "params": mine} for s in _settings(user)]
    opt = build_optimizer(type(user), groups, dict(user.defaults))
    expect_fused = "fused" in user.defaults
    assert opt.param_groups[0].get("fused") is (True if expect_fused else None)
    for _ in range(10):
        grads = [torch.randn_like(p) for p in mine]
        for p, q, g in zip(mine, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        user.step()
    for p, q in zip(mine, theirs, strict=True):
        # SGD's fused kernel is bit-identical here; Adam's rounds differently
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


class _NoFused(torch.optim.SGD):
    """An optimizer whose fused path is refused, as torch does for some dtypes."""

    def __init__(self, params, **kw):
        if kw.get("fused"):
            raise RuntimeError("fused=True is not supported here")
        super().__init__(params, **kw)


def test_build_optimizer_falls_back_to_the_users_settings():
    p = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer(_NoFused, [{"params": [p]}], {"lr": 0.5, "fused": None})
    assert opt.param_groups[0]["fused"] is None
    p.grad = torch.ones(4)
    opt.step()
    assert p.tolist() == [0.5] * 4


def _store(defaults: dict, hyper: dict) -> ShardStore:
    return ShardStore(
        ServerSpec(
            optimizer=torch.optim.SGD,
            defaults=defaults,
            hyper=[hyper],
            group_of=[0],
            numels=[6],
            shard_range=(0, 6),
            shard=np.arange(6.0, dtype=np.float32),
            buffers=None,
            compensation=Compensation(),
            staleness_bound=None,
            max_updates=None,
            part_elems=4,
        )
    )


def test_a_loaded_checkpoint_keeps_the_servers_kernel_choice():
    settings = {"lr": 0.1, "momentum": 0.9, "fused": None, "foreach": None}
    store = _store(dict(settings), dict(settings))
    opt = store.optimizers[0][0]
    assert opt.param_groups[0]["fused"] is True
    store.grad.fill_(1.0)
    store.apply(0, [0.1], 1.0)
    saved = store.state()
    # a checkpoint written before servers chose a kernel
    saved["optimizers"][0]["param_groups"][0]["fused"] = None
    store.load(saved)
    assert opt.param_groups[0]["fused"] is True
    assert "momentum_buffer" in next(iter(opt.state.values()))
    # the user's explicit choice is kept
    chosen = {**settings, "fused": False}
    assert (
        _store(dict(chosen), dict(chosen)).optimizers[0][0].param_groups[0]["fused"]
        is False
    )


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_an_optimizer_is_rebuilt_from_its_own_defaults(cls):
    # torch 2.13's AdamW lists decoupled_weight_decay in its defaults (from
    # Adam) but its constructor refuses the keyword; servers rebuild the
    # user's optimizer from exactly these defaults
    param = torch.nn.Parameter(torch.zeros(4))
    user = cls([param], lr=0.01, weight_decay=0.1)
    groups = [{**{k: v for k, v in user.param_groups[0].items()}, "params": [param]}]
    rebuilt = build_optimizer(cls, groups, dict(user.defaults))
    assert type(rebuilt) is cls
    assert rebuilt.param_groups[0]["weight_decay"] == 0.1
