"""Findings stay readable however many there are (issue 46 items 3 and 8): at most
``REPEATS_SHOWN`` lines of one kind, then one line counting the rest (``--json`` keeps every
one); pickle globals outside the allowlist end with one line of every ``--allow-global`` that
accepts them, to copy as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_cli.render.human import REPEATS_SHOWN
from tests.conftest import run_cli

pytestmark = pytest.mark.requires_torch


def _index_with_missing_names(d: Path, missing: int) -> Path:
    """A real safetensors shard and an HF index naming ``missing`` tensors it does not hold."""
    import torch
    from safetensors.torch import save_file

    d.mkdir()
    shard = "model-00001-of-00001.safetensors"
    save_file({"a": torch.zeros(2)}, d / shard)
    weight_map = {"a": shard} | {f"missing.{i}": shard for i in range(missing)}
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def test_repeated_findings_are_counted_after_the_first_few(tmp_path: Path) -> None:
    d = _index_with_missing_names(tmp_path / "hf", 3000)
    r = run_cli("validate", d)
    assert r.exit_code == 1
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    named = [x for x in lines if "missing." in x]
    assert len(named) == REPEATS_SHOWN
    assert lines[-1] == ("error: ... and 2,990 more missing-tensor findings "
                         "(--json lists every one)")
    assert "INVALID" in r.stdout and "3000 errors" in r.stdout
    doc = json.loads(run_cli("validate", d, "--json").stdout)
    found = [f for c in doc["checkpoints"] for f in c["findings"]
             if f["code"] == "missing-tensor"]
    assert len(found) == 3000


def test_a_few_findings_are_all_printed(tmp_path: Path) -> None:
    d = _index_with_missing_names(tmp_path / "hf", REPEATS_SHOWN)
    r = run_cli("validate", d)
    assert len([x for x in r.output.splitlines() if "missing." in x]) == REPEATS_SHOWN
    assert "more missing-tensor" not in r.output


def test_unsafe_globals_end_with_one_line_to_copy(tmp_path: Path) -> None:
    from tests.helpers import pickle_corpus as pc

    names = [("os", "system"), ("subprocess", "call"), ("mymod.sub", "Thing")]
    payload = pc.dct(**{f"k{i}": pc.call(pc.glob(m, n), pc.s("x"))
                        for i, (m, n) in enumerate(names)})
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pc.torch_zip(pc._records(pc.state_dict(payload))))
    for command in ("validate", "inspect"):
        r = run_cli(command, evil)
        hints = [x for x in r.output.splitlines() if x.startswith("hint: only if you trust")]
        assert hints == ["hint: only if you trust the file, every global above is accepted "
                         "by: --allow-global mymod.sub.Thing --allow-global os.system "
                         "--allow-global subprocess.call"], (command, r.output)
    # The line, copied, is what makes the file pass (the file is never run either way).
    flags = hints[0].split("accepted by: ")[1].split()
    r = run_cli("validate", evil, *flags)
    assert r.exit_code == 0, r.output
