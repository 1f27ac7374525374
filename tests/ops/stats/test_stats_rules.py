"""``ckpt stats``' rules on real runs (issue 46): a LoRA run with warmup and PEFT naming, no
step-0 save, is clean while learning rates x1000 and x100 still flag; Lightning's callback
state is never judged; a truncated checkpoint in a run is an anomaly; complex values are
taken as their modulus; moments neither overflow nor underflow; a run mixing two models says
so."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch

PEFT = "base_model.model.layers.{}.q_proj"  # peft's names: base_layer, lora_A/B.default


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "cache"))


def stats_json(*args: str | Path, code: int = 0) -> dict[str, Any]:
    r = run_cli("stats", *args, "--json")
    assert r.exit_code == code, r.stdout + r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def found(doc: dict[str, Any]) -> set[tuple[int | None, str, str]]:
    return {(a["step"], a["module"], a["kind"]) for a in doc["anomalies"]}


class _LoraLayer(torch.nn.Module):
    """peft's LoraLayer around a Linear: a frozen ``base_layer``, ``lora_A.default`` (kaiming)
    and ``lora_B.default`` (zeros), as ``get_peft_model`` builds it."""

    def __init__(self, d: int = 32, r: int = 8) -> None:
        super().__init__()
        self.base_layer = torch.nn.Linear(d, d).requires_grad_(False)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(d, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, d, bias=False)})
        torch.nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def lora_run(root: Path, *, boost_at: int | None = None, boost: float = 1.0,
             layers: int = 2, steps: int = 60, every: int = 10, warmup: int = 50) -> list[int]:
    """A LoRA fine-tune with linear LR warmup, saved every ``every`` steps from ``every`` on
    (no step-0 save, as Trainer's ``save_steps``), PEFT names; the LR times ``boost`` for
    the ``every`` steps before step ``boost_at``."""
    root.mkdir()
    gen = torch.manual_seed(0)
    layers_ = torch.nn.ModuleList([_LoraLayer() for _ in range(layers)])
    opt = torch.optim.AdamW([p for p in layers_.parameters() if p.requires_grad], lr=2e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    saved = []
    for step in range(1, steps + 1):
        hot = boost_at is not None and boost_at - every < step <= boost_at
        for g in opt.param_groups:
            g["lr"] = sched.get_last_lr()[0] * (boost if hot else 1.0)
        opt.zero_grad()
        h = x
        for layer in layers_:
            h = layer(h)
        torch.nn.functional.mse_loss(h, y).backward()
        opt.step()
        sched.step()
        if step % every == 0:
            sd = {f"{PEFT.format(i)}.{k}": v.clone() for i, layer in enumerate(layers_)
                  for k, v in layer.state_dict().items()}
            torch.save({"model": sd, "step": step}, root / f"step_{step}.pt")
            saved.append(step)
    return saved


def b_module(i: int) -> str:
    return f"{PEFT.format(i)}.lora_B.default"  # the "model" container key: not shown


def test_a_lora_run_with_warmup_and_no_step_0_save_is_clean(tmp_path: Path) -> None:
    steps = lora_run(tmp_path / "run")
    doc = stats_json(tmp_path / "run")
    assert doc["anomalies"] == []
    norms = [{m["name"]: m["l2"] for m in c["modules"]}[b_module(0)]
             for c in doc["checkpoints"]]
    assert norms[1] > 2.5 * norms[0]  # B does grow past --jump from step 10 to 20: warmup
    assert [c["step"] for c in doc["checkpoints"]] == steps


@pytest.mark.parametrize("boost", [1000.0, 100.0])
def test_a_lora_run_whose_lr_blew_up_still_flags(tmp_path: Path, boost: float) -> None:
    lora_run(tmp_path / "run", boost_at=30, boost=boost)
    doc = stats_json(tmp_path / "run", code=1)
    jumps = {(s, m) for s, m, k in found(doc) if k == "norm-jump"}
    assert (30, b_module(0)) in jumps and all(s == 30 for s, _ in jumps)


def test_lightning_callback_state_is_never_judged(lightning_dir: Path) -> None:
    # ModelCheckpoint keeps best_model_score = inf (no monitor): on purpose, every save
    doc = stats_json(lightning_dir, "--all")
    assert doc["anomalies"] == []
    one = stats_json(lightning_dir / "last.ckpt", "--all")
    assert one["anomalies"] == []
    cb = [t for t in one["tensors"] if t["name"].startswith("callbacks.")]
    assert cb and sum(t["inf"] for t in cb) >= 1  # still shown: counted, not judged


def test_a_truncated_checkpoint_in_a_run_is_an_anomaly(tmp_path: Path) -> None:
    lora_run(tmp_path / "run", steps=40)
    p = tmp_path / "run" / "step_30.pt"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    doc = stats_json(tmp_path / "run", code=1)
    [a] = doc["anomalies"]
    assert (a["step"], a["checkpoint"], a["kind"]) == (30, "step_30.pt", "unreadable")
    assert a["module"] == "(checkpoint)" and a["message"].startswith("checkpoint not read: ")
    assert "step_30.pt" not in {s["name"] for s in doc["skipped"]}
    assert doc["last_good"]["name"] == "step_20.pt"  # not step_40: after the damage


def test_complex_values_are_taken_as_their_modulus(tmp_path: Path) -> None:
    z = torch.randn(1000, dtype=torch.complex64, generator=torch.manual_seed(3))
    torch.save({"z": z}, tmp_path / "c.pt")
    [t] = stats_json(tmp_path / "c.pt", "--all")["tensors"]
    mod = z.abs().double()
    assert math.isclose(t["mean"], float(mod.mean()), rel_tol=1e-6)
    assert math.isclose(t["l2"], float(mod.norm()), rel_tol=1e-6)
    assert t["min"] >= 0 and math.isclose(t["max"], float(mod.max()), rel_tol=1e-6)


def test_moments_neither_overflow_nor_underflow(tmp_path: Path) -> None:
    torch.save({"big": torch.tensor([1e200, -1e200, 3e200], dtype=torch.float64),
                "small": torch.tensor([1e-200, 2e-200], dtype=torch.float64)},
               tmp_path / "x.pt")
    t = {d["name"]: d for d in stats_json(tmp_path / "x.pt", "--all")["tensors"]}
    assert math.isclose(t["big"]["std"], 2e200, rel_tol=1e-12)
    assert math.isclose(t["big"]["l2"], math.sqrt(11) * 1e200, rel_tol=1e-12)
    assert math.isclose(t["small"]["l2"], math.sqrt(5) * 1e-200, rel_tol=1e-12)
    assert math.isclose(t["small"]["std"], math.sqrt(0.5) * 1e-200, rel_tol=1e-12)


def test_a_run_mixing_two_models_says_so(tmp_path: Path) -> None:
    lora_run(tmp_path / "run", steps=20)
    other = tmp_path / "other"
    lora_run(other, steps=30, layers=3)
    (other / "step_30.pt").rename(tmp_path / "run" / "step_30.pt")
    doc = stats_json(tmp_path / "run", code=1)
    [a] = doc["anomalies"]
    assert (a["step"], a["kind"], a["added"], a["removed"]) == (30, "mismatch", 4, 0)
    assert "not the model of step_20.pt" in a["message"]
