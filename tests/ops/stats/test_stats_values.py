"""``ckpt stats`` figures against references computed here: dtypes, non-finite values and
integers, optimizer state and other tensors (--all), FP8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt_cli.ops.stats.result import module_of
from tests.conftest import run_cli, third_party_quiet
from tests.ops.stats.conftest import (
    _small_windows,
    _tiny,
    assert_same,
    check_modules,
    check_tensors,
    module_docs,
    stats_doc,
    tensor_docs,
    tiny_model,
    unique_storages,
    untied,
)

# Every test here has a private stats cache (conftest.py).
pytestmark = [pytest.mark.requires_torch, pytest.mark.usefixtures("_private_cache")]


# -- dtypes, non-finite values, integers ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    """BF16 and FP16 weights (from ``model.to(dtype)``): figures of the stored values widened
    exactly, the same from the torch zip and from safetensors, per tensor and module."""
    from safetensors.torch import load_file, save_file

    model = tiny_model().to(dtype)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    save_file(untied(model.state_dict()), tmp_path / "m.safetensors")
    ref = load_file(tmp_path / "m.safetensors")
    assert ref["embed.weight"].dtype == dtype
    for f in ("m.pt", "m.safetensors"):
        doc = stats_doc(tmp_path / f, depth=2)
        want = "BF16" if dtype == torch.bfloat16 else "F16"
        assert tensor_docs(doc)["embed.weight"]["dtype"] == want
        check_tensors(doc, ref)
        check_modules(doc, unique_storages(torch.load(tmp_path / f, weights_only=True)), 2)
    # 1e-40 stays a (subnormal) BF16 value but underflows to zero in FP16
    assert tensor_docs(doc)["embed.weight"]["zeros"] == (1 if dtype == torch.float16 else 0)


def _poisoned(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights with NaN, +Inf and -Inf put into real tensors, and one tensor
    entirely NaN (no finite value at all)."""
    sd = {k: v.to(dtype) if v.is_floating_point() else v
          for k, v in untied(tiny_model().state_dict()).items()}
    w = sd["layers.1.mlp.fc.weight"]
    w[0, 0] = w[5, 3] = w[23, 15] = float("nan")
    w[1, 1] = w[2, 2] = float("inf")
    w[3, 3] = float("-inf")
    sd["embed.weight"][600, 100] = float("-inf")
    sd["layers.0.attn.q_proj.bias"].fill_(float("nan"))
    return sd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_values_are_counted_and_left_out(tmp_path: Path,
                                                    dtype: torch.dtype) -> None:
    """NaN and ±Inf are counted exactly and kept out of mean/std/min/max/absmax/L2 (torch's
    figures of the finite values); a tensor with no finite value has no moments; the CLI
    exits 1 with a ``nan`` and an ``inf`` anomaly naming the modules, and 0 on clean weights."""

    from safetensors.torch import save_file

    sd = _poisoned(dtype)
    save_file(sd, tmp_path / "bad.safetensors")
    torch.save(sd, tmp_path / "bad.pt")
    for f in ("bad.safetensors", "bad.pt"):
        doc = stats_doc(tmp_path / f)
        check_tensors(doc, sd)
        check_modules(doc, sd, None)
    fc = tensor_docs(doc)["layers.1.mlp.fc.weight"]
    assert (fc["nan"], fc["inf"], fc["numel"]) == (3, 3, 400)
    gone = tensor_docs(doc)["layers.0.attn.q_proj.bias"]
    assert gone["nan"] == 16 and gone["mean"] is None and gone["std"] is None
    r = run_cli("stats", tmp_path / "bad.safetensors", "--json", "--no-cache")
    assert r.exit_code == 1, r.output
    flagged = {(a["kind"], a["module"]) for a in json.loads(r.stdout)["anomalies"]}
    assert flagged == {("nan", "layers.1.mlp.fc"), ("inf", "layers.1.mlp.fc"),
                       ("nan", "layers.0.attn.q_proj"), ("inf", "embed")}
    save_file(untied(tiny_model().state_dict()), tmp_path / "good.safetensors")
    r = run_cli("stats", tmp_path / "good.safetensors", "--json", "--no-cache")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["anomalies"] == []


def test_filter_selects_by_glob(formats: dict[str, Path]) -> None:
    """``--filter`` keeps exactly the names the glob matches (fnmatch, ``*`` across dots),
    and the modules of those; one matching nothing is an input error (exit 2)."""
    import fnmatch

    names = list(tensor_docs(stats_doc(formats["safetensors"])))
    for glob in ("layers.*.mlp.*", "*.bias", "layers.1.*", "embed.weight"):
        r = run_cli("stats", formats["safetensors"], "--filter", glob, "--json", "--no-cache")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        want = {n for n in names if fnmatch.fnmatchcase(n, glob)}
        assert want and set(tensor_docs(doc)) == want, glob
        assert {m["name"] for m in doc["modules"]} == {module_of(n, None) for n in want}
    r = run_cli("stats", formats["safetensors"], "--filter", "nothing.*", "--no-cache")
    assert r.exit_code == 2 and "nothing.*" in r.output


def test_all_adds_adam_state_of_a_real_step(tmp_path: Path) -> None:
    """A training checkpoint after one real Adam step (torch.save of model, optimizer and an
    int32 counter): by default only the model's tensors and buffers; with ``everything``
    (``--all``) the optimizer's exp_avg / exp_avg_sq / step too, each equal to torch's figures
    of the loaded tensor. The embedding's exp_avg_sq holds exact zeros (rows no token used)
    and ``tiny`` values (a gradient of 1e-9 squared), counted as torch counts them."""

    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.tensor([3, 5, 5, 600])
    x = model.embed(ids)
    loss = x.sum() * 1e-9 + model.layers[0].mlp.fc(torch.randn(3, 16)).pow(2).sum()
    loss.backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1,
                "counter": torch.arange(-5, 1000, dtype=torch.int32)}, tmp_path / "train.pt")
    ck = torch.load(tmp_path / "train.pt", weights_only=True)
    weights = {f"model.{k}": v for k, v in ck["model"].items()}
    state = {f"optimizer.state.{i}.{k}": v for i, s in ck["optimizer"]["state"].items()
             for k, v in s.items()}
    assert len(state) == 3 * 3  # the parameters the loss reached: exp_avg, exp_avg_sq, step

    doc = stats_doc(tmp_path / "train.pt")  # the integer counter is grouped as a buffer
    assert doc["scope"] == "weights" and set(tensor_docs(doc)) == set(weights) | {"counter"}
    assert tensor_docs(doc)["counter"]["group"] == "buffer"
    check_tensors(doc, weights)

    r = run_cli("stats", tmp_path / "train.pt", "--all", "--json", "--no-cache")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["scope"] == "all"
    assert set(tensor_docs(doc)) == set(weights) | set(state) | {"counter"}
    check_tensors(doc, {**weights, **state, "counter": ck["counter"]})
    embed = [k for k, v in state.items() if k.endswith("exp_avg_sq") and v.shape == (640, 512)]
    sq = state[embed[0]]
    got = tensor_docs(doc)[embed[0]]
    assert got["zeros"] == int((sq == 0).sum()) == 637 * 512
    assert got["tiny"] == _tiny(sq) == 3 * 512
    assert got["max"] == float(sq.max().double())
    counter = tensor_docs(doc)["counter"]
    assert (counter["dtype"], counter["min"], counter["max"]) == ("I32", -5.0, 999.0)


def test_hf_trainer_checkpoint_with_all(hf_trainer_dir: Path) -> None:
    """An HF Trainer checkpoint (transformers' own save: model.safetensors, optimizer.pt,
    rng_state.pth): model weights equal to safetensors' load, and with ``everything`` AdamW's
    state (per parameter index) and the RNG state's uint8 bytes equal to torch.load's."""
    from safetensors.torch import load_file

    ck = hf_trainer_dir / "checkpoint-4"
    model = load_file(ck / "model.safetensors")
    doc = stats_doc(ck, depth=3)
    assert set(tensor_docs(doc)) == set(model)
    check_tensors(doc, model)
    check_modules(doc, model, 3)
    opt = torch.load(ck / "optimizer.pt", weights_only=True)
    state = {f"optimizer.state.{i}.{k}": v for i, s in opt["state"].items()
             for k, v in s.items()}
    rng = torch.load(ck / "rng_state.pth", weights_only=False)
    full = stats_doc(ck, all_tensors=True)
    assert full["scope"] == "all"
    check_tensors(full, {**model, **state, "rng_state.cpu": rng["cpu"]})
    sq = {k: v for k, v in state.items() if k.endswith("exp_avg_sq")}
    got = tensor_docs(full)
    assert sum(got[k]["zeros"] for k in sq) == sum(int((v == 0).sum()) for v in sq.values())
    assert sum(got[k]["tiny"] for k in sq) == sum(_tiny(v) for v in sq.values())


# -- FP8 ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``ckpt convert --to fp8`` of a tiny Llama (transformers' save) in the block, channel
    and tensor layouts (block leaves the 400-wide MLP in BF16: not whole 128-blocks)."""
    from tests.helpers.fp8 import convert_each_layout
    from tests.helpers.makers import tiny_llama

    with third_party_quiet():
        src = tiny_llama(tmp_path_factory.mktemp("llama") / "src", 400)
    return convert_each_layout(src, tmp_path_factory.mktemp("fp8"), "--max-shard-size",
                               "100KB")  # some scales in another shard than their weight


def dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w.float() * scale`` in FP32, the scale broadcast per 128x128 block (a 2-D scale of
    more than one column), per row (``[rows, 1]``) or per tensor."""
    s = scale.float()
    if s.dim() == 2 and s.shape[1] != 1:
        s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    return w.float() * s


def fp8_reference(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint's values as ckpt should read them: FP8 weights dequantized with their
    scale, scales not on their own; and which scale each FP8 weight was dequantized with."""
    from tests.helpers.loads import safetensors_dir

    raw = safetensors_dir(out)
    ref: dict[str, torch.Tensor] = {}
    scales: dict[str, str] = {}
    for name, t in raw.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            key = next(name + s for s in ("_scale_inv", "_scale") if name + s in raw)
            ref[name] = dequantized(t, raw[key])
            scales[name] = key
        else:
            ref[name] = t
    return ref, scales


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_fp8_figures_are_of_the_dequantized_values(fp8_outputs: dict[str, Path], layout: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 outputs of ``ckpt convert --to fp8``: each FP8 weight's figures are those of
    ``w.float() * scale`` (broadcast per block, row or tensor; FP32, then float64), the scale
    named in ``dequantized_with`` and not reported on its own; modules roll up the dequantized
    values; reading in windows of 1,000 bytes (250 values: across rows, blocks and pieces)
    changes nothing."""
    out = fp8_outputs[layout]
    ref, scales = fp8_reference(out)
    assert len(scales) == (8 if layout == "block" else 14)
    where = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    split = any(where[w] != where[s] for w, s in scales.items())
    assert split == (layout != "block")  # the block layout's writer keeps the pairs together
    doc = stats_doc(out, depth=3)
    got = tensor_docs(doc)
    assert set(got) == set(ref)
    check_tensors(doc, ref)
    check_modules(doc, ref, 3)
    for name, t in got.items():
        assert t["dequantized_with"] == scales.get(name), name
        assert t["dtype"] == ("F8_E4M3" if name in scales else "BF16"), name
    sizes = _small_windows(monkeypatch, 1000)
    small = stats_doc(out, depth=3)
    assert max(sizes) == 250 and len(sizes) > 4 * 128 * 256 // 250
    for name, fig in tensor_docs(small).items():
        assert_same(f"{layout} in small windows: {name}", fig, got[name])
    for name, fig in module_docs(small).items():
        assert_same(f"{layout} in small windows: module {name}", fig, module_docs(doc)[name])
