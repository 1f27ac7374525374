"""Resumed runs with ckpt's training callbacks (issue 37 items 3, 4 and 8): an HF Trainer run
resumed from its newest checkpoint keeps it through a failing save; a Lightning checkpoint that
``prune --thin-after`` thinned resumes in Lightning itself; the README's Lightning example runs
as written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_cli.ops.resume import latest_verified
from ckpt_cli.trust import ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.lightning_parts import fit_tiny, tiny_module, truncate_half
from tests.helpers.loads import holds_optimizer_state
from tests.helpers.makers import tiny_lm_data

pytestmark = pytest.mark.requires_torch


def _hf_train(out: Path, steps: int, callbacks: list[Any], resume: str | None = None,
              save_steps: int = 3) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=save_steps,
                             save_total_limit=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="steps", disable_tqdm=True)
    with third_party_quiet():
        Trainer(model=model, args=args, train_dataset=tiny_lm_data(),
                callbacks=callbacks).train(resume_from_checkpoint=resume)


def test_hf_resume_with_a_failing_next_save_keeps_the_resume_point(tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from ckpt_cli.integrations.hf import CkptVerifyCallback

    out = tmp_path / "out"
    _hf_train(out, 12, [CkptVerifyCallback()])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-9"]
    resume = latest_verified(out)
    assert resume == out / "checkpoint-12"

    class BreakSave15(TrainerCallback):  # type: ignore[misc]
        """Damages checkpoint-15 right after Trainer wrote it (before the verification)."""

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if state.global_step == 15:
                truncate_half(out / "checkpoint-15" / "model.safetensors")
            return control

    _hf_train(out, 15, [BreakSave15(), CkptVerifyCallback()], resume=str(resume))
    book = ledger.read_ledger(out)
    assert book is not None and book.latest()["checkpoint-15"].verdict == "bad"
    # Rotation (save_total_limit=2) kept the resume point, not the older checkpoint-9.
    assert (out / "checkpoint-12").is_dir()
    assert latest_verified(out, verify="full") == out / "checkpoint-12"


def test_hf_explicit_rollback_with_two_bad_saves_keeps_the_resume_point(tmp_path: Path) -> None:
    """Issue 45 item 3: resumed from checkpoint-6 while checkpoint-8 (verified) is the newest,
    both of the run's own saves (8 and 10) bad: rotation keeps checkpoint-6."""
    from transformers import TrainerCallback

    from ckpt_cli.integrations.hf import CkptVerifyCallback

    out = tmp_path / "out"
    _hf_train(out, 8, [CkptVerifyCallback()], save_steps=2)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert latest_verified(out) == out / "checkpoint-8"

    class BreakEverySave(TrainerCallback):  # type: ignore[misc]
        """Damages each checkpoint right after Trainer wrote it (before the verification)."""

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            truncate_half(out / f"checkpoint-{state.global_step}" / "model.safetensors")
            return control

    _hf_train(out, 10, [BreakEverySave(), CkptVerifyCallback()],
              resume=str(out / "checkpoint-6"), save_steps=2)
    book = ledger.read_ledger(out)
    assert book is not None
    latest = book.latest()
    assert (latest["checkpoint-8"].verdict, latest["checkpoint-10"].verdict) == ("bad", "bad")
    # Rotation (save_total_limit=2) kept the resume point and the newest save.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-6"]
    assert latest_verified(out, verify="full") == out / "checkpoint-6"


def test_a_thinned_lightning_checkpoint_resumes_with_a_fresh_optimizer(tmp_path: Path) -> None:
    from ckpt_cli.integrations.lightning import VerifiedModelCheckpoint

    out = tmp_path / "ckpts"
    ck = VerifiedModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1,
                                 filename="{step}")
    with third_party_quiet():
        fit_tiny([ck], steps=6, samples=64, devices=1)
    r = run_cli("prune", out, "--thin-after", "1", "--grace", "0", "--yes")
    assert r.exit_code == 0, r.output
    thinned = out / "step=4.ckpt"
    state = torch.load(thinned, weights_only=True)
    assert not holds_optimizer_state(state) and "state_dict" in state
    # validate: a note, not a warning, since the ledger says it was thinned on purpose.
    v = run_cli("validate", thinned, "--strict")
    assert v.exit_code == 0, v.output
    assert "0 warnings" in v.stdout
    v = run_cli("validate", thinned, "--json")
    assert "thinned by ckpt prune --thin-after" in v.stdout

    import lightning as L

    ck2 = VerifiedModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1,
                                  filename="{step}")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer = L.Trainer(max_steps=8, accelerator="cpu", callbacks=[ck2], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, devices=1)
    with third_party_quiet():
        trainer.fit(tiny_module(), loader, ckpt_path=thinned)
    assert trainer.global_step == 8  # resumed at step 4, not from scratch
    book = ledger.read_ledger(out)
    assert book is not None and book.latest()["step=8.ckpt"].verdict == "good"
    assert holds_optimizer_state(torch.load(out / "step=8.ckpt", weights_only=True))


def _docs_block(page: str, needle: str) -> str:
    """The ``python`` block of ``docs/PAGE`` that holds ``needle``, exactly as written (read
    by the parser the docs examples test uses)."""
    from tests.test_docs_examples import blocks

    (found,) = [b.commands[0][0] for b in blocks()
                if b.lang == "python" and b.page.name == page and needle in b.commands[0][0]]
    return found


def test_the_docs_lightning_example_resumes_from_what_it_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/trust.md's Lightning example, run twice as written: the first run's saves are all
    verified good, and the second resumes from the newest of them (issue 37: the README's
    example raised MisconfigurationException, save_top_k=2 without a monitor)."""
    source = _docs_block("trust.md", "VerifiedModelCheckpoint")
    monkeypatch.chdir(tmp_path)
    first: dict[str, object] = {}
    with third_party_quiet():
        exec(source, first)
    ckpts = tmp_path / "ckpts"
    book = ledger.read_ledger(ckpts)
    assert book is not None and book.latest()
    assert all(e.verdict == "good" for e in book.latest().values())
    resume = latest_verified(ckpts)
    assert resume is not None and resume.exists()
    second: dict[str, object] = {}
    with third_party_quiet():
        exec(source, second)
    trainer = second["trainer"]
    # The second fit loaded the checkpoint the first verified (Lightning records the path it
    # restored from), and ended where the first did.
    assert Path(trainer.ckpt_path).resolve() == resume.resolve()  # type: ignore[attr-defined]
    assert trainer.global_step == first["trainer"].global_step  # type: ignore[attr-defined]
