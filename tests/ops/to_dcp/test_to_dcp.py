"""``ckpt convert SRC --to dcp`` (issue 48), in one process: what is written loads back bit for
bit through ``dcp.load`` + ``set_state_dict``, the CLI and the other commands read it, and what
ckpt cannot map is refused by name with nothing written. The multi-process FSDP2 resumes are
in test_resume.py (plain torch) and test_resume_deepspeed.py."""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.requires_torch

torch = pytest.importorskip("torch")

import ckpt_cli  # noqa: E402
from ckpt_cli.errors import CkptError, CorruptCheckpointError  # noqa: E402
from ckpt_cli.ops.to_dcp.dcpmeta import Item  # noqa: E402
from ckpt_cli.ops.to_dcp.state import LazyTensor  # noqa: E402
from ckpt_cli.ops.to_dcp.writer import _buckets, write_dcp  # noqa: E402
from tests.helpers import fsdp_resume as fr  # noqa: E402


def _save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer | None,
          sched: Any = None, **extra: Any) -> Path:
    d: dict[str, Any] = {"model": model.state_dict(), **extra}
    if opt is not None:
        d["optimizer"] = opt.state_dict()
    if sched is not None:
        d["lr_scheduler"] = sched.state_dict()
    torch.save(d, path)
    return path


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer, Any]:
    model, opt, sched = fr.source_run(3)
    return _save(tmp_path / "train.pt", model, opt, sched, step=3), model, opt, sched


def _load(out: Path, layout: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
          sched: Any) -> int:
    """Load ``out`` the way a resuming loop does; the step it recorded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    titan = layout == "torchtitan"
    opts = StateDictOptions(flatten_optimizer_state_dict=titan)
    msd, osd = get_state_dict(model, opt, options=opts)
    state: dict[str, Any] = ({**msd, "optimizer": osd} if titan
                             else {"model": msd, "optim": osd})
    state["lr_scheduler"] = sched.state_dict()
    state["train_state"] = {"step": torch.tensor(0, dtype=torch.int32) if titan else 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note on single-process loads
        dcp.load(state, checkpoint_id=str(out))
    set_state_dict(model, opt, model_state_dict={k: state[k] for k in msd} if titan
                   else state["model"], optim_state_dict=state["optimizer" if titan
                                                               else "optim"], options=opts)
    sched.load_state_dict(state["lr_scheduler"])
    return int(state["train_state"]["step"])


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(123)  # other weights than the source's: the load must replace them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = fr.make_optimizer(model)
    return model, opt, fr.make_scheduler(opt)


@pytest.mark.parametrize("layout", ["torchtitan", "recipe"])
def test_loads_back_bit_for_bit(trained: Any, tmp_path: Path, layout: str) -> None:
    src, model, opt, sched = trained
    r = ckpt_cli.convert(src, tmp_path / "out", to="dcp", dcp_layout=layout)
    assert r.source_format == "torch" and r.metadata["ckpt.optimizer"] == "AdamW"
    m2, o2, s2 = _fresh()
    assert _load(tmp_path / "out", layout, m2, o2, s2) == 3
    for k, v in model.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    got, want = fr.by_fqn(m2, o2), fr.by_fqn(model, opt)
    assert set(got) == set(want)
    for fqn, entries in want.items():
        for key, v in entries.items():
            assert torch.equal(got[fqn][key], v), (fqn, key)
    assert o2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert s2.state_dict() == sched.state_dict()


def test_cli_json_validate_inspect_diff(trained: Any, tmp_path: Path,
                                        cli: Callable[..., Any]) -> None:
    src = trained[0]
    out = tmp_path / "out"
    r = cli("convert", src, "--to", "dcp", "-o", out, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["metadata"]["ckpt.conversion"] == "torch -> dcp (torchtitan)"
    assert doc["metadata"]["ckpt.step"] == "3" and doc["index_file"] == ".metadata"
    names = {t["name"] for t in doc["tensors"]}
    assert {"0.weight", "optimizer.state.0.weight.exp_avg",
            "optimizer.state.3.bias.exp_avg_sq", "train_state.step"} <= names
    v = cli("validate", out, "--require", "optimizer,step")
    assert v.exit_code == 0, v.output
    i = cli("inspect", out, "--json")
    assert i.exit_code == 0 and json.loads(i.stdout)["step"] == 3
    # The recipe layout, converted back to torchtitan's: the same checkpoint.
    cli("convert", out, "--to", "dcp", "--dcp-layout", "recipe", "-o", tmp_path / "r")
    assert cli("convert", tmp_path / "r", "--to", "dcp", "-o", tmp_path / "t").exit_code == 0
    d = cli("diff", out, tmp_path / "t", "--all", "--json")
    assert d.exit_code == 0, d.output


@pytest.mark.parametrize("layout", ["torchtitan", "recipe"])
def test_diff_source_against_output(trained: Any, tmp_path: Path, layout: str,
                                    cli: Callable[..., Any]) -> None:
    """``ckpt diff SRC OUT --all``: the source's optimizer ids (``optimizer.state.0.exp_avg``)
    meet the output's FQNs (``optimizer.``/``optim.state.0.weight.exp_avg``) by parameter
    order, so every weight and moment is compared, and identical (issue 48)."""
    src, model, opt, _ = trained
    out = tmp_path / "out"
    assert cli("convert", src, "--to", "dcp", "--dcp-layout", layout, "-o", out).exit_code == 0
    for a, b in ((src, out), (out, src)):
        doc = json.loads(cli("diff", a, b, "--all", "--json").stdout)
        status = {t["name"]: t["status"] for t in doc["tensors"]}
        prefix = "optimizer." if layout == "torchtitan" else "optim."
        want = {f"{prefix}state.{fqn}.{key}" for fqn in fr.by_fqn(model, opt)
                for key in ("exp_avg", "exp_avg_sq", "step")}
        weights = {n if layout == "torchtitan" else f"model.{n}" for n in model.state_dict()}
        assert want | weights <= set(status)
        assert all(status[n] == "identical" for n in want | weights), status
        one_sided = {o["name"] for o in doc["only_in_a"] + doc["only_in_b"]}
        # Left one-sided: rng_state vs rng.cpu, train_state.step (the source's step is a number).
        assert not {n for n in one_sided if n.startswith(("optimizer.", "optim."))
                    or n in weights}, one_sided
        assert "matched" in doc["optimizer_ids"] and "parameter order" in doc["optimizer_ids"]
    # The default scope (weights only) is as before: no optimizer matching.
    doc = json.loads(cli("diff", src, out, "--json").stdout)
    assert doc["optimizer_ids"] is None and doc["equal"], doc["differences"]


def test_diff_ids_unmatched_says_why(tmp_path: Path, cli: Callable[..., Any]) -> None:
    """Two param groups: the ids cannot be named; diff leaves them one-sided and says why."""
    model, opt, _ = fr.source_run(1)
    out = tmp_path / "out"
    ckpt_cli.convert(_save(tmp_path / "one.pt", model, opt), out, to="dcp")
    ps = list(model.parameters())
    two = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}])
    two.load_state_dict({**opt.state_dict(), "param_groups": [
        {**opt.state_dict()["param_groups"][0], "params": [0, 1]},
        {**opt.state_dict()["param_groups"][0], "params": [2, 3, 4, 5]}]})
    doc = json.loads(cli("diff", _save(tmp_path / "two.pt", model, two), out, "--all",
                         "--json").stdout)
    assert "not matched" in doc["optimizer_ids"] and "2 param groups" in doc["optimizer_ids"]
    assert any(o["name"].startswith("optimizer.state.0.") for o in doc["only_in_a"])


def test_sgd_momentum(tmp_path: Path) -> None:
    model = fr.tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(2):
        x, y = fr.batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    src = _save(tmp_path / "sgd.pt", model, opt, step=2)
    r = ckpt_cli.convert(src, tmp_path / "out", to="dcp", dcp_layout="recipe")
    assert r.metadata["ckpt.optimizer"] == "SGD"
    assert "optim.state.3.weight.momentum_buffer" in r.tensors


def _refused(src: Path, tmp_path: Path, *words: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(CkptError) as e:
        ckpt_cli.convert(src, out, to="dcp")
    for w in words:
        assert w in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".out.ckpt-tmp-*"))


def test_refuses_several_param_groups(tmp_path: Path) -> None:
    model = fr.tiny_model()
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}])
    _refused(_save(tmp_path / "g.pt", model, opt), tmp_path, "2 param groups",
             "cannot be known")


def test_refuses_counts_that_differ(tmp_path: Path) -> None:
    model = fr.tiny_model()
    opt = torch.optim.AdamW(list(model.parameters())[1:])  # a frozen first weight
    _refused(_save(tmp_path / "c.pt", model, opt), tmp_path, "holds 5 parameters",
             "the model 6")


def test_refuses_state_it_cannot_place(tmp_path: Path) -> None:
    model = fr.tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    sd = opt.state_dict()
    # Adafactor-like factored second moments: a row vector per matrix.
    sd["state"] = {i: {"exp_avg_sq_row": torch.zeros(p.shape[0])}
                   for i, p in enumerate(model.parameters())}
    torch.save({"model": model.state_dict(), "optimizer": sd}, tmp_path / "f.pt")
    _refused(tmp_path / "f.pt", tmp_path, "'exp_avg_sq_row' of 0.weight", "shape [16]",
             "[16, 8]")


def test_weights_only_source_says_so(tmp_path: Path, cli: Callable[..., Any]) -> None:
    src = _save(tmp_path / "w.pt", fr.tiny_model(), None, step=5)
    r = ckpt_cli.convert(src, tmp_path / "out", to="dcp")
    assert any("no optimizer state" in n for n in r.notes)
    assert r.metadata["ckpt.optimizer"] == "none"
    v = cli("validate", tmp_path / "out", "--require", "optimizer,step")
    assert v.exit_code == 1 and "optimizer" in v.output


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("touch BOOM",))


def test_never_runs_pickled_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model, opt, sched = fr.source_run(1)
    src = _save(tmp_path / "h.pt", model, opt, sched, step=1, extra=Boom())
    r = ckpt_cli.convert(src, tmp_path / "out", to="dcp")
    assert not (tmp_path / "BOOM").exists()
    assert any("not carried: extra" in n for n in r.notes)
    assert any("system" in w.message for w in r.warnings)  # said, as convert says it
    # The same object where a value must be carried: refused by name, never run.
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = Boom()
    (tmp_path / "two").mkdir()
    torch.save({"model": model.state_dict(), "optimizer": sd}, tmp_path / "two" / "h2.pt")
    _refused(tmp_path / "two" / "h2.pt", tmp_path / "two", "param_groups", "system")
    assert not (tmp_path / "BOOM").exists()


def test_options_and_destination(trained: Any, tmp_path: Path, cli: Callable[..., Any]) -> None:
    src = trained[0]
    r = cli("convert", src, "--to", "dcp", "--max-shard-size", "1GB", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "--max-shard-size does not apply to a DCP output" in r.output
    r = cli("convert", src, "--to", "dcp", "--dcp-layout", "nemo", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "torchtitan or recipe" in r.output
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    assert cli("convert", src, "--to", "dcp", "-o", tmp_path / "o").exit_code == 2
    assert (tmp_path / "o" / "keep").exists()
    assert cli("convert", src, "--to", "dcp", "-o", tmp_path / "o", "--force").exit_code == 0
    assert (tmp_path / "o" / ".metadata").exists() and not (tmp_path / "o" / "keep").exists()


def test_one_tensor_held_at_a_time(tmp_path: Path) -> None:
    """Tensors are read ahead of the writer only within the memory budget and let go once
    written: with a budget below one tensor, one is held at a time (with a bucket smaller than
    every tensor: a file each)."""
    alive: list[weakref.ref[np.ndarray]] = []
    most = 0

    def loader(i: int) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            nonlocal most
            most = max(most, sum(1 for a in alive if a() is not None))
            arr = np.full((64, 64), i, dtype=np.float32)
            alive.append(weakref.ref(arr))
            return arr
        return load

    tree = {f"w{i}": LazyTensor("F32", (64, 64), loader(i)) for i in range(12)}
    res = write_dcp(tree, tmp_path / "out", bucket_bytes=1024, max_memory=1)
    assert len(alive) == 12 and most <= 1, most
    assert res.tensors == 12 and len(res.files) == 13  # a file per tensor, then .metadata
    assert res.files[-1].path == ".metadata"


def test_buckets() -> None:
    def item(n: int | None) -> Item:
        return Item("x", ("x",), 1.0 if n is None else LazyTensor("F32", (n,), np.zeros))

    items = [item(None), item(10), item(1000), item(20), item(None), item(30)]
    got = _buckets(items, 200)  # 4 bytes an element: 40, 4000, 80, 120 bytes
    assert [len(b) for b in got] == [4, 1, 1]
    assert got[0] == [items[0], items[1], items[3], items[4]]
    assert got[1] == [items[5]] and got[2] == [items[2]]


def test_a_tensor_unlike_its_description_is_refused(tmp_path: Path) -> None:
    tree = {"w": LazyTensor("F32", (4,), lambda: np.zeros(5, dtype=np.float32))}
    with pytest.raises(CorruptCheckpointError, match="w: read shape"):
        write_dcp(tree, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_deepspeed_own_adam_groups_get_torch_adam_keys() -> None:
    """DeepSpeed's CPU Adam / FusedAdam groups hold lr, betas (a list), eps, weight_decay and
    bias_correction; a torch AdamW's state dict asks dcp.load for each of its group keys
    (``Missing key ... maximize`` before), so torch's defaults are filled in."""
    from ckpt_cli.ops.to_dcp.deepspeed import _torch_groups
    from ckpt_cli.ops.to_dcp.state import TrainingState

    ds = {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}
    st = TrainingState("deepspeed", {}, optimizer="AdamW", param_groups=[
        {**ds, "bias_correction": True, "params": ["a"]},
        {**ds, "bias_correction": False, "params": ["b"]}])
    _torch_groups(st)
    want = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, 0.99),
                             weight_decay=0.1).param_groups[0]
    first, second = st.param_groups
    assert first == {**want, "params": ["a"]}  # every key, torch's values
    assert second == {**want, "bias_correction": False, "params": ["b"]}
    assert any("without bias correction" in n for n in st.notes)
    assert any("torch's Adam defaults filled in for amsgrad, capturable" in n for n in st.notes)
