"""ckpt_cli.render.human: the pure formatting helpers behind every human table."""

from __future__ import annotations

import io

import pytest
from rich.text import Text

from ckpt_cli.render import human
from ckpt_cli.render.inspect_tables import tied_text


@pytest.mark.parametrize("n,want", [(None, "-"), (0, "0 Bytes"), (999, "999 Bytes"),
                                    (1000, "1.0 kB"), (14_200_000, "14.2 MB"),
                                    (1.5e12, "1.5 TB")])
def test_size_uses_decimal_units(n: int | float | None, want: str) -> None:
    assert human.size(n) == want


def test_rate() -> None:
    assert human.rate(1e10) == "10.0 GB/s"
    assert human.rate(None) == "-"


@pytest.mark.parametrize("seconds,long,short", [
    (None, "-", "-"),
    (1, "1 second", "1s"),
    (3.5, "3.5 seconds", "3.5s"),
    (2459, "40 minutes and 59 seconds", "40m 59s"),
    (3599.6, "1 hour", "1h"),  # 59m 59.6s rounds up to a whole hour, not "59m 60s"
    (86400 * 1.8, "1 day and 19 hours", "1d 19h"),
])
def test_duration_two_units_at_most(seconds: float | None, long: str, short: str) -> None:
    assert human.duration(seconds) == long
    assert human.duration(seconds, short=True) == short


def test_duration_beyond_dates_is_in_years() -> None:
    assert human.duration(2e12).endswith(" years")


@pytest.mark.parametrize("n,want", [(None, "-"), (5, "5"), (999, "999"), (1000, "1.0K"),
                                    (1_234_567, "1.2M"), (175_000_000_000, "175.0B"),
                                    (3 * 10**12, "3.0T"), (-2500, "-2.5K")])
def test_count(n: int | None, want: str) -> None:
    assert human.count(n) == want


def test_bar_is_proportional_at_eighth_resolution() -> None:
    width = 8
    lengths = []
    for eighths in range(0, 65):
        text = human.bar(eighths / 64, width).plain
        assert len(text) == width  # always padded to the full width
        full = text.count("█")
        part = text.rstrip(" ")[full:]
        assert full == eighths // 8
        assert len(part) == (1 if eighths % 8 else 0)
        lengths.append(full * 8 + (" ▏▎▍▌▋▊▉".index(part) if part else 0))
    assert lengths == list(range(65))


def test_bar_clamps_and_survives_zero() -> None:
    assert human.bar(0.0).plain == " " * 24
    assert human.bar(-1.0, 4).plain == "    "
    assert human.bar(5.0, 4).plain == "████"
    assert human.bar(0.0, 0).plain == ""


def test_tied_text_limits_and_says_how_counted() -> None:
    tied = [{"name": "lm_head", "tied_to": "embed", "counted_twice": False, "tie": "storage"},
            {"name": "x", "tied_to": "y", "counted_twice": True, "tie": "values"},
            {"name": "p", "tied_to": "q", "counted_twice": False, "tie": "values"}]
    text = tied_text(tied, limit=2)
    assert text == ("lm_head = embed (one storage): counted once; x may repeat y (same shape "
                    "and dtype; bytes not compared): counted twice; and 1 more")
    assert "same shape, dtype and sampled bytes" in tied_text(tied[2:])
    assert tied_text([]) == ""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_width_off_a_terminal_does_not_wrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert human._width(io.StringIO()) == human.UNWRAPPED_WIDTH
    assert human._width(object()) == human.UNWRAPPED_WIDTH  # no isatty at all
    assert human._width(_Tty()) is None
    monkeypatch.setenv("COLUMNS", "100")
    assert human._width(io.StringIO()) is None


def _render(renderable: object, width: int, *, color: bool = False) -> list[str]:
    buf = io.StringIO()
    con = human._Console(file=buf, width=width, highlight=False, force_terminal=color,
                         no_color=not color, color_system="standard" if color else None)
    con.print(renderable)
    return buf.getvalue().splitlines()


def _fit_table() -> human.FitTable:
    col = human.Col
    t = human.table(col("Checkpoint", kind="name"), col("Step", "right", drop=3),
                    col("Modified", drop=2), col("Size", "right", drop=1),
                    col("Files", "right", drop=0), col("Status", kind="text"))
    t.add_row("step_000100_of_the_sft_run", "1,000,000", "2026-12-04 17:21", "1.7 MB", "12",
              "incomplete: no .metadata yet (a write in progress?)")
    t.add_row("step_000200_of_the_sft_run", "2,000,000", "2026-12-05 09:03", "1.8 MB", "12",
              "complete, latest")
    return t


@pytest.mark.parametrize("width", [40, 60, 100, 200])
def test_fit_table_drops_the_least_important_columns_first(width: int) -> None:
    lines = _render(_fit_table(), width)
    assert max(map(len, lines)) <= width
    assert not any(line != line.rstrip() for line in lines)
    assert not any("…" in line for line in lines)
    header = lines[0].split()
    # Columns go lowest priority first: Files, then Size, then Modified, then Step.
    order = ["Files", "Size", "Modified", "Step"]
    dropped = [c for c in order if c not in header]
    assert dropped == order[:len(dropped)], header
    assert header[0] == "Checkpoint" and "Status" in header[-1:]
    for name, step, date in (("step_000100_of_the_sft_run", "1,000,000", "2026-12-04 17:21"),
                             ("step_000200_of_the_sft_run", "2,000,000", "2026-12-05 09:03")):
        row = next(line for line in lines if line.startswith(name))  # the name: whole
        if "Step" in header:
            assert step in row.split()
        if "Modified" in header:
            assert date in row
    if width >= 100:
        assert dropped == []
    if width == 60:
        assert dropped == ["Files", "Size", "Modified"]  # 26 + 9 + 16 + 10 + gaps > 60


def test_fit_table_folds_a_name_longer_than_half_the_width() -> None:
    t = human.table(human.Col("Name", kind="name"), human.Col("Params", "right", drop=0))
    name = "model.vision_tower.encoder.layers.23.attention_with_rotary_embeddings.weight"
    t.add_row(name, "16,777,216")
    lines = _render(t, 60)
    assert max(map(len, lines)) <= 60
    assert "16,777,216" in lines[1]
    assert "".join(line.split("  ")[0] for line in lines[1:]) == name  # folded, all there


def test_fit_table_folds_names_after_dots_and_says_what_it_left_out() -> None:
    """At 60 columns a name breaks after a "." (never mid-word: issue 39's "out_proj.weigh" /
    "t"), and the columns dropped are named below the table."""
    t = human.table(human.Col("Name", kind="name"), human.Col("Dtype", drop=2),
                    human.Col("Shape", drop=1), human.Col("Params", "right", drop=0))
    name = "model.decoder.layers.11.self_attn.out_proj.weight"
    t.add_row(name, "F32", "[1024, 1024]", "1,048,576")
    lines = _render(t, 40)
    at = lines.index(next(x for x in lines if x.startswith("(")))
    rows, note = lines[1:at], " ".join(lines[at:])
    parts = [line.split("  ")[0] for line in rows]
    assert "".join(parts) == name
    assert all(p.endswith(".") for p in parts[:-1]), parts  # each line ends at a dot
    assert "left out at 40 columns" in note
    gone = [c for c in ("Dtype", "Shape", "Params") if c not in lines[0].split()]
    assert gone and all(c in note for c in gone)
    assert not any(line.startswith("(") for line in _render(t, 120))  # nothing left out
    assert human.fold_name("a.b", 10) == "a.b"
    assert human.fold_name("x" * 25, 10).plain.split("\n") == ["x" * 10, "x" * 10, "x" * 5]


def test_stdout_strips_trailing_spaces_and_keeps_styles() -> None:
    t = human.table(human.Col("A", kind="name"), human.Col("Status", kind="text"))
    t.add_row("x", "complete, latest")
    t.add_row("a_longer_name", Text("ok", style="green"))
    plain = _render(t, 80)
    assert plain == ["A              Status", "x              complete, latest",
                     "a_longer_name  ok"]
    coloured = _render(t, 80, color=True)
    assert not any(line.rstrip("\x1b[0123456789;m").endswith(" ") for line in coloured)
    assert "\x1b[32mok\x1b[0m" in coloured[-1]


def test_grid_wraps_facts_and_keeps_labels_whole() -> None:
    g = human.grid()
    g.add_row("Parameters", "134,912 (134.9K)")
    g.add_row("Scope", "model weights and buffers; not compared: A 84 optimizer, 1 other")
    lines = _render(g, 40)
    assert lines[0] == "Parameters  134,912 (134.9K)"
    assert max(map(len, lines)) <= 40 and len(lines) > 2
