"""``read_lightning`` (issue 48): a Lightning ``.ckpt``'s training state equals what restoring
it gives: the wrapped model loaded from ``state_dict`` and the optimizer
``configure_optimizers`` builds loaded from ``optimizer_states[0]`` (as Lightning's strategy
does), each parameter's state looked up through ``model.named_parameters()``."""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt_cli.errors import CkptError, UnsupportedError
from ckpt_cli.ops.to_dcp.lightning import read_lightning
from ckpt_cli.ops.to_dcp.state import LazyTensor, TrainingState
from tests.conftest import third_party_quiet

pytestmark = [pytest.mark.requires_torch,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="lightning is not installed")]


@pytest.fixture(scope="module")
def norm_sgd_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Lightning run of Linear, BatchNorm1d, Linear trained with SGD and momentum, and a
    StepLR schedule."""
    from tests.helpers.makers import lightning_run

    with third_party_quiet():
        return lightning_run(tmp_path_factory.mktemp("plnorm") / "ckpts", norm=True, sgd=True,
                             scheduler=True)


def _t(v: LazyTensor | float | int) -> torch.Tensor:
    if isinstance(v, LazyTensor):
        arr = v.load()
        assert arr.shape == v.shape
        return torch.from_numpy(np.array(arr, copy=True))
    return torch.tensor(v)


def _load(path: Path) -> dict[str, Any]:
    with third_party_quiet():
        return dict(torch.load(path, weights_only=True))


def _check_restored(st: TrainingState, ck: dict[str, Any], net: torch.nn.Module,
                    opt: torch.optim.Optimizer) -> None:
    """``st`` equals ``net`` and ``opt`` restored from ``ck`` as Lightning restores them."""
    net.load_state_dict({k.removeprefix("net."): v for k, v in ck["state_dict"].items()})
    opt.load_state_dict(ck["optimizer_states"][0])
    name_of = {id(p): n for n, p in net.named_parameters()}
    for ours, theirs in zip(st.param_groups, opt.param_groups, strict=True):
        assert ours["params"] == [name_of[id(p)] for p in theirs["params"]]
        assert {k: v for k, v in ours.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"}
    assert len(st.optimizer_state) == len(opt.state) == len(name_of)
    for p, s in opt.state.items():
        mine = st.optimizer_state[name_of[id(p)]]
        assert set(mine) == set(s)
        for k, v in s.items():
            assert torch.equal(_t(mine[k]), v), (name_of[id(p)], k)
    sd = net.state_dict()
    assert set(sd) == set(st.model)
    for k, v in sd.items():
        assert torch.equal(_t(st.model[k]), v), k
    assert st.step == ck["global_step"]
    assert st.extra["epoch"] == ck["epoch"]


def test_adam_state_equals_the_restored_optimizer(lightning_dir: Path) -> None:
    path = lightning_dir / "last.ckpt"
    st = read_lightning(path)
    net = torch.nn.Linear(4, 8)
    _check_restored(st, _load(path), net, torch.optim.Adam(net.parameters(), lr=0.01))
    assert st.optimizer == "Adam"
    assert list(st.model) == ["weight", "bias"]  # the LightningModule's "net." dropped
    assert st.step == 4 and st.lr_scheduler is None
    assert st.extra["loops"] == _load(path)["loops"]  # carried as saved


def test_sgd_momentum_and_batchnorm_buffers(norm_sgd_dir: Path) -> None:
    path = norm_sgd_dir / "last.ckpt"
    st = read_lightning(path)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    _check_restored(st, _load(path), net, opt)
    assert st.optimizer == "SGD"
    assert st.lr_scheduler == _load(path)["lr_schedulers"][0]
    assert st.lr_scheduler is not None and st.lr_scheduler["last_epoch"] == 4
    assert st.param_groups[0]["lr"] == 0.01 * 0.5 ** 4
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(st.model)
    assert "1.running_mean" not in st.optimizer_state


def _with_state_dict(src: Path, dest: Path, extra: dict[str, torch.Tensor]) -> Path:
    ck = _load(src)
    ck["state_dict"] = OrderedDict([*ck["state_dict"].items(), *extra.items()])
    torch.save(ck, dest)
    return dest


def test_a_buffer_the_shapes_rule_out_is_skipped(lightning_dir: Path, tmp_path: Path) -> None:
    path = _with_state_dict(lightning_dir / "last.ckpt", tmp_path / "x.ckpt",
                            {"aux.scale": torch.ones(3)})
    st = read_lightning(path)
    assert st.param_groups[0]["params"] == ["net.weight", "net.bias"]  # two attributes: kept
    assert "aux.scale" in st.model and "aux.scale" not in st.optimizer_state
    assert any("1 skipped" in n for n in st.notes)


def test_an_ambiguous_buffer_is_refused(lightning_dir: Path, tmp_path: Path) -> None:
    path = _with_state_dict(lightning_dir / "last.ckpt", tmp_path / "x.ckpt",
                            {"net.extra": torch.ones(8)})  # shaped like net.bias
    with pytest.raises(CkptError, match="more than one match"):
        read_lightning(path)


def test_weights_only_checkpoints_are_refused(lightning_dir: Path, tmp_path: Path) -> None:
    ck = _load(lightning_dir / "last.ckpt")
    del ck["optimizer_states"]
    torch.save(ck, tmp_path / "w.ckpt")
    with pytest.raises(CkptError, match="restart the optimizer"):
        read_lightning(tmp_path / "w.ckpt")


def test_several_optimizers_are_refused(lightning_dir: Path, tmp_path: Path) -> None:
    ck = _load(lightning_dir / "last.ckpt")
    ck["optimizer_states"] = ck["optimizer_states"] * 2
    torch.save(ck, tmp_path / "two.ckpt")
    with pytest.raises(UnsupportedError, match="2 optimizers"):
        read_lightning(tmp_path / "two.ckpt")


class _Runs:
    """Pickles as a call of ``os.system`` (a hostile hyper-parameter)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def test_hostile_hyperparameters_never_run_and_are_reported(lightning_dir: Path,
                                                            tmp_path: Path) -> None:
    ck = _load(lightning_dir / "last.ckpt")
    marker = tmp_path / "ran"
    ck["hyper_parameters"] = {"callback": _Runs(marker)}
    torch.save(ck, tmp_path / "h.ckpt")
    st = read_lightning(tmp_path / "h.ckpt")
    assert not marker.exists()
    assert "hyper_parameters" not in st.extra
    assert any("h.ckpt" in n and "system" in n for n in st.notes), st.notes
    assert any(n.startswith("hyper_parameters not carried") for n in st.notes)
    assert set(st.optimizer_state) == {"weight", "bias"}  # the training state is whole


def test_a_parameter_id_that_is_not_an_integer_is_a_clear_error(lightning_dir: Path,
                                                                tmp_path: Path) -> None:
    ck = _load(lightning_dir / "last.ckpt")
    ck["optimizer_states"][0]["param_groups"][0]["params"][0] = [0]
    torch.save(ck, tmp_path / "ids.ckpt")
    with pytest.raises(CkptError, match="lists a list as a parameter id"):
        read_lightning(tmp_path / "ids.ckpt")


def test_a_strategy_directory_is_refused_with_a_hint(tmp_path: Path) -> None:
    d = tmp_path / "epoch=0-step=4.ckpt"
    d.mkdir()  # what the DeepSpeed and FSDP strategies save
    with pytest.raises(CkptError, match=r"not a Lightning \.ckpt file") as e:
        read_lightning(d)
    assert e.value.hint is not None and "DeepSpeed" in e.value.hint


def test_a_compiled_wrapped_model_loses_its_wrapper_too(lightning_dir: Path,
                                                        tmp_path: Path) -> None:
    ck = _load(lightning_dir / "last.ckpt")
    ck["state_dict"] = OrderedDict(  # self.net = torch.compile(net)
        (k.replace("net.", "net._orig_mod.", 1), v) for k, v in ck["state_dict"].items())
    torch.save(ck, tmp_path / "c.ckpt")
    st = read_lightning(tmp_path / "c.ckpt")
    assert list(st.model) == ["weight", "bias"]
    assert st.param_groups[0]["params"] == ["weight", "bias"]


def _grouped(src: Path, dest: Path, head_out: int, head_first: bool, empty: bool = False
             ) -> Path:
    """``src`` with a two-layer net trained by Adam in two groups (the head's own LR), the
    head's group listed first or second in ``configure_optimizers`` (then an empty group)."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, head_out))
    head, body = list(net[1].parameters()), list(net[0].parameters())
    groups = [{"params": head, "lr": 0.1}, {"params": body}]
    extra = [{"params": [], "lr": 0.5}] if empty else []
    opt = torch.optim.Adam((groups if head_first else groups[::-1]) + extra, lr=0.01)
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    ck = _load(src)
    ck["state_dict"] = OrderedDict((f"net.{k}", v) for k, v in net.state_dict().items())
    ck["optimizer_states"] = [opt.state_dict()]
    torch.save(ck, dest)
    return dest


@pytest.mark.parametrize("head_first", [True, False])
def test_param_groups_in_another_order_than_the_model(lightning_dir: Path, tmp_path: Path,
                                                      head_first: bool) -> None:
    path = _grouped(lightning_dir / "last.ckpt", tmp_path / "g.ckpt", 4, head_first)
    st = read_lightning(path)
    head = next(g for g in st.param_groups if g["lr"] == 0.1)
    body = next(g for g in st.param_groups if g["lr"] == 0.01)
    assert head["params"] == ["1.weight", "1.bias"] and body["params"] == ["0.weight", "0.bias"]
    assert ([g["lr"] for g in st.param_groups] == [0.1, 0.01]) is head_first
    assert st.optimizer_state["1.weight"]["exp_avg"].shape == (4, 8)
    assert any("param groups: follow the model in the order [1, 0]" in n
               for n in st.notes) is head_first


def test_param_groups_that_fit_in_two_orders_are_refused(lightning_dir: Path,
                                                         tmp_path: Path) -> None:
    """Both layers 8x8: the head's group first fits the shapes as well as the body's, so
    naming them in the saved order would swap the two layers' moments and LRs."""
    path = _grouped(lightning_dir / "last.ckpt", tmp_path / "g.ckpt", 8, head_first=True)
    with pytest.raises(CkptError, match="more than one order"):
        read_lightning(path)


def test_an_empty_param_group_makes_no_order_ambiguous(lightning_dir: Path,
                                                       tmp_path: Path) -> None:
    path = _grouped(lightning_dir / "last.ckpt", tmp_path / "g.ckpt", 4, True, empty=True)
    st = read_lightning(path)
    assert [g["params"] for g in st.param_groups] == [["1.weight", "1.bias"],
                                                      ["0.weight", "0.bias"], []]
