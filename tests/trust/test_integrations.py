"""The training-loop callbacks: HF Trainer and Lightning runs on CPU, with a save damaged on
purpose, show that each save is verified and recorded and that rotation never deletes the last
verified checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from ckpt_cli.ops.resume import latest_verified
from ckpt_cli.trust import ledger
from tests.conftest import run_cli, third_party_quiet
from tests.helpers.lightning_parts import fit_tiny, save_breaker, truncate_half
from tests.helpers.makers import tiny_lm_data

pytestmark = pytest.mark.requires_torch


def _verdicts(run: Path) -> dict[str, str]:
    book = ledger.read_ledger(run)
    assert book is not None
    return {p: e.verdict for p, e in book.latest().items()}


def test_hf_trainer_callback_keeps_the_last_verified_checkpoint(tmp_path: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from ckpt_cli.integrations.hf import CkptVerifyCallback

    out = tmp_path / "out"
    seen: dict[int, tuple[bool, Path | None]] = {}

    class BreakSave4(TrainerCallback):  # type: ignore[misc]
        """Damages checkpoint-4 after Trainer wrote it (a save that went wrong)."""

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if state.global_step == 4:
                truncate_half(out / "checkpoint-4" / "model.safetensors")
            return control

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            seen[state.global_step] = ((out / "checkpoint-2").is_dir(), latest_verified(out))
            return control

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=6, save_steps=2,
                             save_total_limit=1, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="steps", disable_tqdm=True)
    verify = CkptVerifyCallback()
    with third_party_quiet():
        Trainer(model=model, args=args, train_dataset=tiny_lm_data(),
                callbacks=[BreakSave4(), verify, Probe()]).train()
    assert _verdicts(out) == {"checkpoint-2": "good", "checkpoint-4": "bad",
                              "checkpoint-6": "good"}
    # While checkpoint-4 (bad) was the newest, rotation (save_total_limit=1) kept checkpoint-2.
    assert seen[4] == (True, out / "checkpoint-2")
    assert seen[6][1] == out / "checkpoint-6"
    assert latest_verified(out, verify="full") == out / "checkpoint-6"
    assert [e.verdict for e in verify.entries] == ["good", "bad", "good"]


def test_hf_callback_refuses_rotation_that_could_delete_the_verified_one(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ckpt_cli.integrations.hf import CkptVerifyCallback

    args = TrainingArguments(output_dir=str(tmp_path), save_total_limit=2, use_cpu=True,
                             eval_strategy="steps", save_strategy="steps",
                             metric_for_best_model="eval_loss", report_to=[])
    with pytest.raises(ValueError, match="save_total_limit"):
        CkptVerifyCallback().on_train_begin(args, TrainerState(), TrainerControl())


def test_lightning_callback_verifies_each_save_and_keeps_the_last_verified(
        tmp_path: Path) -> None:
    from ckpt_cli.integrations.lightning import VerifiedModelCheckpoint

    out = tmp_path / "ckpts"
    # Damages the step-4 file right after Lightning wrote it.
    break_step4 = save_breaker(lambda trainer, _f: trainer.global_step == 4)
    ck = VerifiedModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=1,
                                 filename="{step}")
    with third_party_quiet():
        fit_tiny([break_step4, ck], steps=6, samples=32, devices=1)
    assert _verdicts(out) == {"step=2.ckpt": "good", "step=4.ckpt": "bad",
                              "step=6.ckpt": "good"}
    assert (out / "step=2.ckpt").is_file()  # rotation after the bad save did not delete it
    assert not (out / "step=4.ckpt").exists()  # the bad one went with the next rotation
    assert sorted(p.name for p in out.iterdir()) == [
        "ckpt-ledger.jsonl", "step=2.ckpt", "step=2.ckpt.ckpt-manifest.json", "step=6.ckpt",
        "step=6.ckpt.ckpt-manifest.json"]
    assert latest_verified(out, verify="full") == out / "step=6.ckpt"
    weights = torch.load(latest_verified(out), weights_only=True)  # type: ignore[arg-type]
    assert "state_dict" in weights


TORCHRUN = Path(sys.executable).with_name("torchrun")
HELPERS = Path(__file__).parents[1] / "helpers"


def _torchrun_2(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """A 2-process torchrun world on CPU (gloo) running a helper; its completed process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", NO_COLOR="1", PYTHONPATH=str(HELPERS.parent.parent))
    return subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node=2",
                           str(HELPERS / script), *argv], capture_output=True, text=True,
                          env=env, timeout=400, check=False)  # a hang guard


def _ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]


def _ledger_lines(run: Path) -> list[dict[str, Any]]:
    return [json.loads(s) for s in (run / ledger.LEDGER_NAME).read_text().splitlines()]


def _rank_0_alone_verified(ranks_dir: Path, run: Path,
                           saves: tuple[str, str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both ranks of a 6-step run with the step-4 save broken reached step 6; rank 0 alone
    recorded ``saves`` as good, bad, good, and the ledger holds each once. Returns the two
    ranks' reports (``rank-R.json`` in ``ranks_dir``)."""
    zero, one = _ranks(ranks_dir)
    assert zero["global_step"] == one["global_step"] == 6
    verdicts = list(zip(saves, ("good", "bad", "good"), strict=True))
    assert zero["entries"] == [list(v) for v in verdicts]
    assert one["entries"] == []
    assert [(e["path"], e["verdict"]) for e in _ledger_lines(run)] == verdicts
    return zero, one


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_hf_callback_under_ddp_rank_0_verifies_after_every_rank_saved(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Rank 1 is the slow one: it writes its rng_state_1.pth only after rank 0 reached on_save.
    p = _torchrun_2("hf_ddp.py", str(out), "6", "--break-at", "4", "--slow-rng-rank", "1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # Only rank 0 verified and wrote: one ledger line per save, none twice.
    zero, one = _rank_0_alone_verified(out, out, ("checkpoint-2", "checkpoint-4",
                                                  "checkpoint-6"))
    # While the bad checkpoint-4 was the newest, rotation (save_total_limit=1) kept
    # checkpoint-2, as every rank saw.
    assert zero["saw"]["4"] == one["saw"]["4"] == ["checkpoint-2", "checkpoint-4"]
    # At the end Trainer keeps only the last verified one (save_total_limit=1).
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]
    # Its manifest covers every rank's files: it was verified after the slow rank finished.
    files = {f["path"] for f in orjson.loads(
        (out / "checkpoint-6" / "ckpt-manifest.json").read_bytes())["files"]}
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= files
    assert latest_verified(out, verify="full") == out / "checkpoint-6"
    r = run_cli("validate", out / "checkpoint-6")
    assert r.exit_code == 0 and "(0 errors, 0 warnings)" in r.stdout, r.stdout


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_hf_callback_under_ddp_stop_on_bad_stops_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = _torchrun_2("hf_ddp.py", str(out), "8", "--break-at", "4", "--stop-on-bad")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    zero, one = _ranks(out)
    assert zero["global_step"] == one["global_step"] == 4  # both stopped at the bad save
    assert [(e["path"], e["verdict"]) for e in _ledger_lines(out)] == [
        ("checkpoint-2", "good"), ("checkpoint-4", "bad")]
    assert latest_verified(out, verify="full") == out / "checkpoint-2"


def _torchrun_2_nodes(script: str, *argv: str) -> list[subprocess.CompletedProcess[str]]:
    """Two torchrun agents on this machine, one process each, as the two nodes of one world
    (static rendezvous on 127.0.0.1); their completed processes."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", NO_COLOR="1", PYTHONPATH=str(HELPERS.parent.parent))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([str(TORCHRUN), "--nnodes=2", f"--node-rank={n}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1",
                               f"--master-port={port}", str(HELPERS / script), *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for n in (0, 1)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=400)  # a hang guard
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _node(out: Path, node: int) -> dict[str, Any]:
    return dict(json.loads((out / f"node-{node}" / f"rank-{node}.json").read_text()))


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_hf_callback_save_on_each_node_verifies_every_nodes_copy(tmp_path: Path) -> None:
    # save_on_each_node: each node's local process zero writes and rotates its own copy, and
    # verifies it. transformers 5.24's save_pretrained writes the weights on global rank 0
    # only (should_save_on_this_rank), so node 1's copies hold no model weights: node 1's own
    # verification must catch that, while node 0's copies are good.
    out = tmp_path / "out"
    for p in _torchrun_2_nodes("hf_ddp.py", str(out), "6", "--each-node", "--break-at", "4",
                               "--break-node", "0"):
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    zero, one = _node(out, 0), _node(out, 1)
    assert zero["global_step"] == one["global_step"] == 6
    assert zero["entries"] == [["checkpoint-2", "good"], ["checkpoint-4", "bad"],
                               ["checkpoint-6", "good"]]
    assert one["entries"] == [["checkpoint-2", "bad"], ["checkpoint-4", "bad"],
                              ["checkpoint-6", "bad"]]
    lines = _ledger_lines(out / "node-1")
    assert [e["path"] for e in lines] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert all("without model weights" in " ".join(e["problems"]) for e in lines), lines
    assert [(e["path"], e["verdict"]) for e in _ledger_lines(out / "node-0")] == [
        ("checkpoint-2", "good"), ("checkpoint-4", "bad"), ("checkpoint-6", "good")]
    # Node 0's rotation (save_total_limit=1) kept its last verified copy while the bad
    # checkpoint-4 was the newest.
    assert zero["saw"]["4"] == ["checkpoint-2", "checkpoint-4"]
    assert latest_verified(out / "node-0", verify="full") == out / "node-0" / "checkpoint-6"
    assert latest_verified(out / "node-1", verify="full") is None


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_hf_callback_save_on_each_node_stop_on_bad_stops_every_node(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for p in _torchrun_2_nodes("hf_ddp.py", str(out), "8", "--each-node", "--stop-on-bad"):
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    zero, one = _node(out, 0), _node(out, 1)
    # Node 0's copy of checkpoint-2 is good, node 1's has no weights: every node stops there.
    assert zero["global_step"] == one["global_step"] == 2
    assert zero["entries"] == [["checkpoint-2", "good"]]
    assert one["entries"] == [["checkpoint-2", "bad"]]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_lightning_callback_under_ddp_only_rank_0_verifies(tmp_path: Path) -> None:
    out = tmp_path / "ckpts"
    p = _torchrun_2("lightning_ddp.py", str(out), "6", "--break-at", "4")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    zero, one = _rank_0_alone_verified(tmp_path, out, ("step=2.ckpt", "step=4.ckpt",
                                                       "step=6.ckpt"))
    # While the bad step=4 was the newest, rotation (save_top_k=1) kept step=2 on every rank's
    # view of the shared directory.
    assert "step=2.ckpt" in zero["saw"]["5"] and "step=4.ckpt" in one["saw"]["5"]
    assert sorted(p.name for p in out.iterdir()) == [
        "ckpt-ledger.jsonl", "step=2.ckpt", "step=2.ckpt.ckpt-manifest.json", "step=6.ckpt",
        "step=6.ckpt.ckpt-manifest.json"]
    assert latest_verified(out, verify="full") == out / "step=6.ckpt"


def test_lightning_callback_verifies_a_copied_last_ckpt_at_every_save(tmp_path: Path) -> None:
    from ckpt_cli.integrations.lightning import VerifiedModelCheckpoint

    out = tmp_path / "ckpts"
    # Damages step=6.ckpt (not last.ckpt) right after Lightning wrote it.
    break_step6 = save_breaker(lambda trainer, f: trainer.global_step == 6
                               and f.name != "last.ckpt")
    # save_last=True: Lightning writes last.ckpt as a copy (not a link) at every save.
    ck = VerifiedModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=1,
                                 save_last=True, filename="{step}")
    with third_party_quiet():
        fit_tiny([break_step6, ck], steps=6, samples=32, devices=1)
    assert not (out / "last.ckpt").is_symlink()
    # Each new last.ckpt is judged on its own bytes, not by the previous save's manifest.
    assert [(e.path, e.verdict, e.step) for e in ck.entries] == [
        ("step=2.ckpt", "good", 2), ("last.ckpt", "good", 2),
        ("step=4.ckpt", "good", 4), ("last.ckpt", "good", 4),
        ("step=6.ckpt", "bad", 6), ("last.ckpt", "good", 6)]
    # last.ckpt (verified, step 6) is the resume point; step=4.ckpt, the last verified file
    # that no later save overwrites, is kept by rotation all the same.
    assert latest_verified(out, verify="full") == out / "last.ckpt"
    assert (out / "step=4.ckpt").is_file()
    weights = torch.load(out / "last.ckpt", weights_only=True)
    assert weights["global_step"] == 6
