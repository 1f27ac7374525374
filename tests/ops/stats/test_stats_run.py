"""``ckpt stats RUN``: anomalies, update ratios, the figure cache, run selection and ``--part``
on runs written by real training loops (torch.save with AdamW stepping an ``nn.Module``, an HF
Trainer run, ``ckpt sample``'s run), locally and on S3 (issue 41's run-mode "Done when")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.train_loop import Loop, injected_run, load_model, module_of
from tests.ops.stats.run_helpers import close, found, stats_json, torch_modules

pytestmark = [pytest.mark.requires_torch,
              # botocore and moto call datetime.utcnow() and friends; not ckpt's code.
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


# --- anomalies ----------------------------------------------------------------------------------

def test_injected_run_flags_exactly_the_jump_the_nan_and_the_frozen_module(
        tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=2, nan_at=3, freeze_from=4)
    steps = [int(p.stem.split("_")[1]) for p in loop.saved]
    doc = stats_json(tmp_path / "run", code=1)
    assert found(doc) == {(steps[2], "layers.1", "norm-jump"),
                          (steps[3], "layers.0", "nan"),
                          (steps[4], "layers.2", "frozen")}
    by = {a["kind"]: a for a in doc["anomalies"]}
    assert {a["checkpoint"] for a in doc["anomalies"]} == {
        loop.saved[2].name, loop.saved[3].name, loop.saved[4].name}
    # the figures that triggered each, as torch computes them
    jump_now = torch_modules(loop.saved[1], loop.saved[2])["layers.1"]
    jump_was = torch_modules(None, loop.saved[1])["layers.1"]
    assert close(by["norm-jump"]["l2"], jump_now["l2"])
    assert close(by["norm-jump"]["previous_l2"], jump_was["l2"])
    assert by["norm-jump"]["ratio"] == by["norm-jump"]["l2"] / by["norm-jump"]["previous_l2"]
    assert 50 < by["norm-jump"]["ratio"] < 200
    assert by["nan"]["nan"] == 1 and by["nan"]["numel"] == 16 * 16 + 16
    frozen_before = torch_modules(loop.saved[2], loop.saved[3])["layers.2"]
    assert by["frozen"]["update_ratio"] == 0.0
    assert close(by["frozen"]["previous_update_ratio"], frozen_before["update_ratio"])
    for a in doc["anomalies"]:
        assert a["message"] and "\n" not in a["message"]
    # the frozen module's weights really are bit-identical from there on
    for a, b in zip(loop.saved[4:], loop.saved[3:], strict=False):
        assert torch.equal(load_model(a)["layers.2.weight"], load_model(b)["layers.2.weight"])


def test_jump_and_filter_choose_what_is_judged(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=2, nan_at=3, freeze_from=4)
    steps = [int(p.stem.split("_")[1]) for p in loop.saved]
    lax = stats_json(tmp_path / "run", "--jump", "200", code=1)
    assert lax["jump"] == 200.0
    assert found(lax) == {(steps[3], "layers.0", "nan"),
                          (steps[4], "layers.2", "frozen")}
    one = stats_json(tmp_path / "run", "--filter", "model.layers.1.*", code=1)
    assert found(one) == {(steps[2], "layers.1", "norm-jump")}
    assert {m["name"] for c in one["checkpoints"] for m in c["modules"]} == {"layers.1"}
    assert stats_json(tmp_path / "run", "--filter", "*.layers.2.*", "--last", "2")[
        "anomalies"] == []  # frozen since before the newest two: nothing changed in them


def test_a_tensor_zeroed_at_one_step_is_flagged_dead(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=4, jump_at=None, nan_at=None,
                        freeze_from=None, dead_at=3)
    doc = stats_json(tmp_path / "run", code=1)
    step = int(loop.saved[3].stem.split("_")[1])
    assert found(doc) == {(step, "head", "dead")}
    (dead,) = doc["anomalies"]
    assert dead["tensor"] == "model.head.weight" and dead["numel"] == 4 * 16


def test_the_same_loop_without_injection_is_clean(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=6, jump_at=None, nan_at=None,
                        freeze_from=None)
    doc = stats_json(tmp_path / "run")
    assert doc["anomalies"] == [] and doc["mode"] == "run"
    assert [c["step"] for c in doc["checkpoints"]] == [0, 2, 4, 6, 8, 10]
    # one of its checkpoints alone: its causal mask's -inf is no anomaly either
    one = stats_json(loop.saved[-1])
    assert one["mode"] == "checkpoint" and one["anomalies"] == []
    mask = next(t for t in one["tensors"] if t["name"] == "model.causal_mask")
    assert mask["inf"] == 8 * 7 // 2 and mask["group"] == "buffer"


def test_a_diverging_run_flags_each_module_once_where_nan_appears(tmp_path: Path,
                                                                  cache: Path) -> None:
    loop = Loop(tmp_path / "run")
    for k in range(6):
        if k == 3:  # a NaN in the live weights: the next steps spread it everywhere
            with torch.no_grad():
                loop.net.layers[1].weight[0, 0] = float("nan")
        loop.checkpoint()
    doc = stats_json(tmp_path / "run", code=1)
    trained = {module_of(n) for n, t in load_model(loop.saved[0]).items()
               if t.is_floating_point() and n != "causal_mask"}
    assert found(doc) == {(6, m, "nan") for m in trained}
    for a in doc["anomalies"]:
        assert a["nan"] == a["numel"]  # every value: the last good checkpoint is step 4


def test_update_ratios_and_norms_equal_torchs_float64(tmp_path: Path, cache: Path) -> None:
    loop = injected_run(tmp_path / "run", checkpoints=5, jump_at=2, nan_at=3, freeze_from=None)
    doc = stats_json(tmp_path / "run", code=1)
    checked = 0
    for i, c in enumerate(doc["checkpoints"]):
        want = torch_modules(loop.saved[i - 1] if i else None, loop.saved[i])
        got = {m["name"]: m for m in c["modules"]}
        assert set(got) == set(want)
        for mod, w in want.items():
            assert close(got[mod]["l2"], w["l2"]), (c["name"], mod)
            assert close(got[mod]["update_ratio"], w["update_ratio"]), (c["name"], mod)
            checked += w["update_ratio"] is not None
    # every module of every later checkpoint has a ratio, except where a value is not
    # finite: the mask's -inf (module "model"), layers.0 at and after its NaN
    assert checked == 4 * 6 - 2
    assert doc["checkpoints"][0]["modules"][0]["update_ratio"] is None


def test_a_batchnorm_step_counter_is_no_norm_jump(tmp_path: Path, cache: Path) -> None:
    # num_batches_tracked (an int64 counter) grows with the step count: 0, 20, 40...
    loop = Loop(tmp_path / "run", every=20, batchnorm=True)
    for _ in range(4):
        loop.checkpoint()
    doc = stats_json(tmp_path / "run")
    assert doc["anomalies"] == []
    bn = [{m["name"]: m for m in c["modules"]}["bn"] for c in doc["checkpoints"]]
    assert bn[1]["l2"] > 2 * bn[0]["l2"]  # the module's figures hold the counter


def test_a_module_of_integer_counters_only_is_not_judged_on_its_norm(
        tmp_path: Path, cache: Path) -> None:
    loop = Loop(tmp_path / "run", every=20, batchnorm=True)
    loop.train(5)
    for _ in range(3):
        loop.checkpoint()  # num_batches_tracked: 5, 25, 45
    doc = stats_json(tmp_path / "run", "--filter", "*num_batches_tracked")
    assert [m["l2"] for c in doc["checkpoints"] for m in c["modules"]] == [5, 25, 45]
    assert doc["anomalies"] == []


class _Lora(torch.nn.Module):
    """A frozen base Linear with a LoRA adapter: ``B`` zero-initialized, as peft does."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(16, 16).requires_grad_(False)
        self.lora_A = torch.nn.Linear(16, 4, bias=False)
        self.lora_B = torch.nn.Linear(4, 16, bias=False)
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))  # type: ignore[no-any-return]


def _lora_run(root: Path, jump_at: int | None = None) -> list[int]:
    root.mkdir()
    gen = torch.manual_seed(0)
    net = _Lora()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
    steps = []
    for k in range(6):
        for _ in range(5 if k else 0):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        step = 5 * k
        sd = {n: t.clone() for n, t in net.state_dict().items()}
        if k == jump_at:
            sd["lora_B.weight"].mul_(100)
        torch.save({"model": sd, "step": step}, root / f"step_{step}.pt")
        steps.append(step)
    return steps


def test_a_lora_adapter_growing_from_zero_is_no_norm_jump(tmp_path: Path,
                                                          cache: Path) -> None:
    _lora_run(tmp_path / "run")
    doc = stats_json(tmp_path / "run")
    assert doc["anomalies"] == []
    norms = [{m["name"]: m["l2"] for m in c["modules"]}["lora_B"]
             for c in doc["checkpoints"]]
    assert norms[0] == 0 and norms[2] > 2 * norms[1]  # Adam: B's norm grows with the steps
    # still a x100 of the adapter is flagged, where it is
    steps = _lora_run(tmp_path / "sick", jump_at=3)
    sick = stats_json(tmp_path / "sick", code=1)
    assert found(sick) == {(steps[3], "lora_B", "norm-jump")}


def test_the_sample_run_has_no_anomaly(sample_run: Path, cache: Path) -> None:
    doc = stats_json(sample_run)
    assert doc["anomalies"] == []
    assert [c["step"] for c in doc["checkpoints"]] == [100, 200, 300, 400]
    assert doc["checkpoints"][-1]["format"] == "dcp"  # the others: step dirs of torch files


def test_an_hf_trainer_run_has_no_anomaly(hf_trainer_dir: Path, cache: Path) -> None:
    doc = stats_json(hf_trainer_dir)
    assert doc["anomalies"] == []
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4"]
    last = doc["checkpoints"][-1]["modules"]
    assert last and all(m["update_ratio"] is not None and m["update_ratio"] > 0 for m in last)


def test_a_lightning_run_with_last_ckpt_is_not_frozen(lightning_dir: Path,
                                                      cache: Path) -> None:
    # last.ckpt is Lightning's copy of the newest save: the same step, the same weights
    doc = stats_json(lightning_dir)
    assert doc["anomalies"] == []
    assert [c["step"] for c in doc["checkpoints"]][:2] == [2, 4]
