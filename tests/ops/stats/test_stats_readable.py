"""``ckpt stats`` output an engineer reads at a glance (issue 46 item 6): module names without
the container's prefix (Lightning's ``state_dict.``, a training dict's ``model.``, DDP's
``module.``), sparklines with a character per checkpoint (the dropped ones marked) under the
first and last step, histogram bars labelled with their ranges, errors as lines under the
table, a byte count never above the files' size, and a plot with a legend outside its axes
and anomaly labels that do not overlap. Checkpoints are written by torch.save, safetensors and
Lightning's Trainer."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from ckpt_cli.ops.stats import StatsOptions, stats
from tests.conftest import run_cli
from tests.helpers.train_loop import injected_run

pytestmark = pytest.mark.requires_torch

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path / "ckpt-cache"))


def wide_run(root: Path, *, layers: int = 21, saves: int = 6,
             boost: dict[int, list[int]] | None = None) -> Path:
    """A run of ``saves`` torch.save checkpoints (``{"model": state_dict, "step": N}``) of a
    ModuleList of ``layers`` Linear layers trained by SGD; ``boost`` maps a save's index to
    the layers whose weight that save holds x100 (a norm jump)."""
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    net = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x = torch.randn(16, 8)
    for k in range(saves):
        for _ in range(2):
            h = x
            for layer in net:
                h = torch.tanh(layer(h))
            loss = h.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        sd = {n: t.detach().clone() for n, t in net.state_dict().items()}
        for i in (boost or {}).get(k, []):
            sd[f"{i}.weight"] *= 100
        torch.save({"model": sd, "step": 2 * k}, root / f"step_{2 * k}.pt")
    return root


def _modules(doc_or_result: object) -> set[str]:
    res = doc_or_result
    return {m.name for c in res.checkpoints for m in c.modules}  # type: ignore[attr-defined]


# -- --depth: the model's own modules -------------------------------------------------------

def test_depth_1_of_a_lightning_run_gives_the_models_top_modules(lightning_dir: Path) -> None:
    """Lightning keeps the LightningModule's weights under ``state_dict.``: depth 1 is its
    module ``net``, not one ``state_dict`` row; tensor names stay whole."""
    res = stats(lightning_dir, StatsOptions(no_cache=True, depth=1))
    assert _modules(res) == {"net"}
    names = {t.name for t in res.checkpoints[0].tensors}
    assert names == {"state_dict.net.weight", "state_dict.net.bias"}
    r = run_cli("stats", lightning_dir, "--depth", "1", "--no-cache")
    assert r.exit_code == 0, r.output
    assert re.search(r"^net\s", r.stdout, re.M) and "state_dict " not in r.stdout


def test_depth_2_of_a_training_dict_has_no_model_row(tmp_path: Path) -> None:
    """``{"model": state_dict}``: the ``model.`` key is the container, not a module. Depth 2
    was ``model.emb``, ``model.layers``... and a ``model`` row (the causal mask at the top of
    the model, L2 0); now depth 1 is the model's top modules and depth 2 one level below."""
    injected_run(tmp_path / "run", checkpoints=2, jump_at=None, nan_at=None, freeze_from=None)
    one = tmp_path / "run" / "step_2.pt"
    d1 = stats(one, StatsOptions(no_cache=True, depth=1))
    assert _modules(d1) == {"emb", "norm", "layers", "head", "causal_mask"}
    d2 = stats(one, StatsOptions(no_cache=True, depth=2))
    assert _modules(d2) == {"emb", "norm", "layers.0", "layers.1", "layers.2", "head",
                            "causal_mask"}
    assert "model" not in _modules(d2)


def test_ddp_and_compile_wrappers_are_stripped_too(tmp_path: Path) -> None:
    """DDP's ``module.`` inside the training dict, torch.compile's ``_orig_mod.`` around it:
    depth 1 is still the model's top modules."""
    torch.manual_seed(1)
    inner = torch.nn.Sequential()
    inner.add_module("enc", torch.nn.Linear(4, 4))
    inner.add_module("dec", torch.nn.Linear(4, 2))
    sd = {f"_orig_mod.module.{k}": v for k, v in inner.state_dict().items()}
    torch.save({"model": sd}, tmp_path / "ddp.pt")
    assert _modules(stats(tmp_path / "ddp.pt", StatsOptions(no_cache=True, depth=1))) == {
        "enc", "dec"}


# -- bytes read, errors -----------------------------------------------------------------------

def _read_line(out: str) -> tuple[float, float]:
    m = re.search(r"^Read\s+([\d.]+) (\w+) of ([\d.]+) (\w+)", out, re.M)
    assert m, out
    unit = {"Bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
    return float(m[1]) * unit[m[2]], float(m[3]) * unit[m[4]]


def test_bytes_read_never_exceed_the_files(tmp_path: Path) -> None:
    """Three views of one storage (the whole, a slice, a transpose) are read three times, but
    the bytes read count each byte of the file once; a truncated file reports what was there,
    never what its header declares."""
    big = torch.randn(500, 500, generator=torch.manual_seed(2))
    views = tmp_path / "views.pt"
    torch.save({"a": big, "b": big[:200], "c": big.t()}, views)
    res = stats(views, StatsOptions(no_cache=True))
    size = views.stat().st_size
    assert 500 * 500 * 4 <= res.bytes_read <= size  # was 2.4 MB: each view counted
    assert res.files_bytes == size
    got, of = _read_line(run_cli("stats", views, "--no-cache").stdout)
    assert got <= of and abs(of - size) < 0.01 * size

    from safetensors.torch import save_file

    full = tmp_path / "full.safetensors"
    save_file({"emb.weight": torch.randn(200, 1000), "layers.0.weight": torch.randn(100, 100),
               "layers.1.weight": torch.randn(30, 100)}, full)
    cut = tmp_path / "cut.safetensors"
    raw = full.read_bytes()
    cut.write_bytes(raw[:int(len(raw) * 0.97)])  # emb whole, the layers cut off
    res = stats(cut, StatsOptions(no_cache=True))
    assert res.bytes_read == 200 * 1000 * 4 <= cut.stat().st_size == res.files_bytes


def test_unreadable_tensors_are_lines_under_the_table_not_rows(tmp_path: Path) -> None:
    """A truncated file: each tensor not read is one line (its name, then why) under the
    table, never a row whose reason lands in the Shape and Mean columns."""
    from safetensors.torch import save_file

    sd = {"emb.weight": torch.randn(200, 1000), "layers.0.weight": torch.randn(100, 100),
          "layers.1.weight": torch.randn(30, 100)}
    save_file(sd, tmp_path / "full.safetensors")
    raw = (tmp_path / "full.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:int(len(raw) * 0.97)])
    r = run_cli("stats", cut, "--no-cache")
    assert r.exit_code == 1, r.output
    out = r.stdout
    table = out[out.index("Tensors ("):out.index("Not read (2):")]
    rows = [ln for ln in table.splitlines()[2:] if ln.strip()]
    assert [ln.split()[0] for ln in rows] == ["emb.weight"]  # the one read
    assert "needs bytes" not in table
    lines = out[out.index("Not read (2):"):].splitlines()[1:3]
    for name, line in zip(("layers.0.weight", "layers.1.weight"), lines, strict=True):
        assert line.startswith(f"  {name}: tensor '{name}' needs bytes up to "), line


# -- --hist -----------------------------------------------------------------------------------

def test_hist_bars_carry_their_ranges(tmp_path: Path) -> None:
    """Values 0.75 (x4), 3.0 and 0.0: bars [0.5, 1) 4, [1, 2) 0, [2, 4) 1, each labelled with
    its range; zeros are not a bar; the table's sparkline sits between the outer edges."""
    torch.save({"w.weight": torch.tensor([0.75, -0.75, 0.75, 0.75, 3.0, 0.0])}, tmp_path / "h.pt")
    r = run_cli("stats", tmp_path / "h.pt", "--hist", "--no-cache")
    assert r.exit_code == 0, r.output
    lines = r.stdout[r.stdout.index("|x| per module"):].splitlines()
    assert lines[1] == "w"
    bars = [re.match(r"\s+(\S+ \S+)\s+(\S*)\s+(\d+)$", ln) for ln in lines[2:5]]
    assert [(m[1], m[3]) for m in bars if m] == [("[0.5, 1)", "4"), ("[1, 2)", "0"),
                                                 ("[2, 4)", "1")]
    assert re.search(r"^w\s.*\s0\.5 .{3} 4\s*$", r.stdout, re.M), r.stdout


# -- run sparklines ---------------------------------------------------------------------------

def test_sparklines_keep_a_place_for_checkpoints_that_dropped_out(tmp_path: Path) -> None:
    """Steps 0..8 every 2 with step 4 truncated and step 6 deleted: each sparkline has 5
    characters, ``✗`` at step 4 and ``·`` at step 6, under a header with steps 0 and 8; the
    legend line names both."""
    injected_run(tmp_path / "run", checkpoints=5, jump_at=None, nan_at=None, freeze_from=None)
    p = tmp_path / "run" / "step_4.pt"
    p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])
    (tmp_path / "run" / "step_6.pt").unlink()
    r = run_cli("stats", tmp_path / "run")
    assert r.exit_code == 1, r.output  # the unreadable checkpoint is an anomaly
    out = r.stdout
    header = next(ln for ln in out.splitlines() if ln.startswith("Module "))
    assert re.search(r"\b0   8\b", header), header
    emb = next(ln for ln in out.splitlines() if ln.startswith("emb "))
    norms = emb.split()[1]
    assert len(norms) == 5 and norms[2] == "✗" and norms[3] == "·", emb
    assert "✗ not readable: step 4" in out and "· missing: step 6" in out
    assert "steps 0 to 8, 3 read" in out


# -- --plot -----------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_of_21_modules_has_a_legend_outside_and_labels_apart(tmp_path: Path) -> None:
    """21 modules, norm jumps in 5 modules at step 4 and one each at steps 6 and 8: the legend
    sits right of the axes, the flagged modules and the most changing are in it (10 in all)
    plus one grey entry for the rest; one label per step, no two overlapping."""
    import matplotlib.pyplot as plt

    from ckpt_cli.render.stats_plot import COLOURED, build_figure

    run = wide_run(tmp_path / "run", boost={2: [1, 2, 3, 4, 5], 3: [7], 4: [9]})
    res = stats(run, StatsOptions(no_cache=True))
    assert len(_modules(res)) == 21
    fig = build_figure(res)
    try:
        [legend] = fig.legends
        entries = [t.get_text() for t in legend.get_texts()]
        assert len(entries) == COLOURED + 1
        assert {"1", "2", "3", "4", "5", "7", "9"} <= set(entries)
        assert entries[-1].startswith("11 other modules")
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        right = max(ax.get_window_extent(renderer).x1 for ax in fig.axes)
        assert legend.get_window_extent(renderer).x0 >= right
        labels = [t for ax in fig.axes for t in ax.texts if t.get_gid() == "anomaly-label"]
        assert len(labels) == 3  # steps 4, 6, 8
        assert labels[0].get_text().count("norm-jump") == 3 and "+2 more" in labels[0].get_text()
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (a, b)
    finally:
        plt.close(fig)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_labels_of_neighbouring_steps_are_stacked(tmp_path: Path) -> None:
    """Anomalies at every step of a long run (labels wider than a step apart): still no two
    labels overlap."""
    import matplotlib.pyplot as plt

    from ckpt_cli.render.stats_plot import build_figure

    run = wide_run(tmp_path / "run", layers=4, saves=12,
                   boost={k: [k % 4] for k in range(1, 12)})
    res = stats(run, StatsOptions(no_cache=True))
    fig = build_figure(res)
    try:
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        labels = [t for ax in fig.axes for t in ax.texts if t.get_gid() == "anomaly-label"]
        assert len(labels) >= 6
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (a, b)
        [legend] = fig.legends
        assert len(legend.get_texts()) == 4  # few modules: each its own entry
    finally:
        plt.close(fig)
