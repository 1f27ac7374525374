"""``plan_prune``: the pure decision, by examples and by properties (hypothesis)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_cli.errors import UsageError
from ckpt_cli.model import Finding, RunEntry, RunListing
from ckpt_cli.ops.prune.retention import PrunePolicy, RunFacts, plan_prune

NOW = 1_800_000_000.0
DAY = 86400.0
ROOT = Path("/runs/x")


def _entry(name: str, step: int | None, *, bytes_: int = 100, age: float = 30 * DAY,
           complete: bool = True, changed_age: float | None = None,
           metrics: dict[str, float] | None = None) -> RunEntry:
    return RunEntry(name=name, path=ROOT / name, step=step,
                    step_source="name" if step is not None else "mtime", format="dir",
                    bytes=bytes_, files=1, mtime=NOW - age, complete=complete,
                    reason=None if complete else "no .metadata",
                    changed=NOW - (age if changed_age is None else changed_age),
                    metrics=metrics or {})


def _listing(*entries: RunEntry, pointers: dict[str, str] | None = None) -> RunListing:
    return RunListing(root=ROOT, entries=list(entries), pointers=pointers or {})


def _deleted(listing: RunListing, policy: PrunePolicy, facts: RunFacts | None = None,
             ) -> list[str]:
    return [d.entry.name for d in plan_prune(listing, policy, NOW, facts).to_delete]


def _steps(*steps: int, **kw: object) -> list[RunEntry]:
    return [_entry(f"step_{s}", s, **kw) for s in steps]  # type: ignore[arg-type]


# -- examples ----------------------------------------------------------------------------------


def test_keep_newest_n() -> None:
    assert _deleted(_listing(*_steps(1, 2, 3, 4)), PrunePolicy(keep=2, grace=0)) == [
        "step_1", "step_2"]


def test_keep_every_is_by_step_multiple() -> None:
    listing = _listing(*_steps(500, 1000, 1500, 2000, 2500))
    assert _deleted(listing, PrunePolicy(keep_every=1000, grace=0)) == [
        "step_500", "step_1500"]  # 2500 is the newest valid


def test_max_total_size_keeps_the_newest_that_fit() -> None:
    listing = _listing(*_steps(1, 2, 3, 4, bytes_=100))
    plan = plan_prune(listing, PrunePolicy(max_total_size=250, grace=0), NOW)
    assert [d.entry.name for d in plan.to_delete] == ["step_1", "step_2"]
    # A budget no rule can meet is reported, not met by deleting protected checkpoints.
    listing = _listing(*_steps(1, 2, bytes_=100), pointers={"latest": "step_1"})
    plan = plan_prune(listing, PrunePolicy(max_total_size=150, grace=0), NOW)
    assert plan.to_delete == [] and [f.code for f in plan.findings] == ["over-budget"]


def test_older_than_keeps_the_recent_ones() -> None:
    listing = _listing(_entry("a", 1, age=10 * DAY), _entry("b", 2, age=3 * DAY),
                       _entry("c", 3, age=1 * DAY))
    plan = plan_prune(listing, PrunePolicy(older_than=7 * DAY, grace=0), NOW)
    assert [d.entry.name for d in plan.to_delete] == ["a"]
    assert plan.decisions[0].reasons == ["not kept by any rule: modified 10.0d ago, older "
                                         "than 7d"]


def test_keep_best_min_and_max_with_ties_to_the_newer() -> None:
    entries = [_entry(f"s{i}", i, metrics={"val_loss": v})
               for i, v in enumerate([0.5, 0.2, 0.2, 0.9, 0.7])]
    listing = _listing(*entries)
    keep = {d.entry.name for d in plan_prune(
        listing, PrunePolicy(keep_best=1, metric="val_loss", grace=0), NOW).kept}
    assert keep == {"s2", "s4"}  # s2 beats s1 on the tie; s4 is the newest valid
    keep = {d.entry.name for d in plan_prune(
        listing, PrunePolicy(keep_best=1, metric="val_loss", mode="max", grace=0), NOW).kept}
    assert keep == {"s3", "s4"}
    # facts.metrics (trainer state, metrics file) win over the name; NaN is no value.
    facts = RunFacts(metrics={"s0": 0.01, "s2": float("nan")})
    keep = {d.entry.name for d in plan_prune(
        listing, PrunePolicy(keep_best=2, metric="val_loss", grace=0), NOW, facts).kept}
    assert keep == {"s0", "s1", "s4"}


def test_protections_override_every_rule() -> None:
    entries = [*_steps(1, 2, 3, 4, 5), _entry("step_6", 6, complete=False),
               _entry("step_7", 7, changed_age=60)]
    listing = _listing(*entries, pointers={"latest": "step_2"})
    facts = RunFacts(locks={"step_3": "step_3.lock"}, pinned={"step_4": "best"},
                     validity={"step_7": "corrupt", "step_5": None})
    plan = plan_prune(listing, PrunePolicy(keep=1, grace=600), NOW, facts)
    by = {d.entry.name: d.protected_by for d in plan.decisions}
    assert by["step_1"] == []
    assert by["step_2"] == ["pointer"]
    assert "newer-than-pointer" in by["step_3"] and "locked" in by["step_3"]
    assert "pinned" in by["step_4"] and "newest-valid" in by["step_5"]
    assert "incomplete" in by["step_6"] and "recent" in by["step_7"]
    assert [d.entry.name for d in plan.to_delete] == ["step_1"]


def test_keep_counts_only_complete_valid_checkpoints() -> None:
    entries = [*_steps(1, 2, 3), _entry("step_4", 4, complete=False)]
    facts = RunFacts(validity={"step_3": "corrupt header", "step_2": None})
    plan = plan_prune(_listing(*entries), PrunePolicy(keep=1, grace=0), NOW, facts)
    two = plan.decisions[1]
    assert plan.newest_valid == "step_2" and not two.delete
    assert two.reasons == ["the newest valid checkpoint: the 2 newer one(s) are incomplete or "
                           "invalid (step_3: corrupt header, step_4: no .metadata)",
                           "newest 1 complete (`keep=1`)"]
    # The corrupt and the incomplete one are newer than the one --keep 1 counts: kept, not
    # counted; what is older than it goes.
    assert "not counted: failed quick validation" in plan.decisions[2].reasons[-1]
    assert [d.entry.name for d in plan.to_delete] == ["step_1"]


def test_keep_counts_only_good_ledger_verdicts() -> None:
    entries = _steps(1, 2, 3, 4, 5)
    facts = RunFacts(ledger=True, verdicts={"step_1": True, "step_2": True, "step_3": False,
                                            "step_4": True},
                     validity={"step_3": "the run ledger's verdict is bad: x"})
    plan = plan_prune(_listing(*entries), PrunePolicy(keep=2, grace=0), NOW, facts)
    by = {d.entry.name: d for d in plan.decisions}
    # step_5 is not verified yet and step_3 is bad: neither is one of the 2 kept.
    assert "not verified yet" in by["step_5"].reasons[-1]
    assert "ledger verdict is bad" in by["step_3"].reasons[-1]
    assert [d.entry.name for d in plan.to_delete] == ["step_1"]
    # Once two good ones are newer, a bad one goes like any other.
    facts.verdicts["step_5"] = True
    plan = plan_prune(_listing(*entries), PrunePolicy(keep=2, grace=0), NOW, facts)
    assert [d.entry.name for d in plan.to_delete] == ["step_1", "step_2", "step_3"]


def test_keep_does_not_count_a_save_in_progress() -> None:
    # step_3 changed a second ago (within --grace): protected and not one of the 2.
    entries = [*_steps(1, 2), _entry("step_3", 3, age=1)]
    plan = plan_prune(_listing(*entries), PrunePolicy(keep=2, grace=60), NOW, RunFacts())
    assert [d.entry.name for d in plan.to_delete] == []
    plan = plan_prune(_listing(*entries, _entry("step_4", 4)), PrunePolicy(keep=2, grace=60),
                      NOW, RunFacts())
    assert [d.entry.name for d in plan.to_delete] == ["step_1"]


def test_halts_without_a_readable_pointer_or_a_valid_checkpoint() -> None:
    listing = _listing(*_steps(1, 2, 3))
    listing.findings.append(Finding("warning", "pointer-unreadable", "cannot tell what latest "
                                                                      "names: empty", "latest"))
    assert _deleted(listing, PrunePolicy(keep=1, grace=0)) == []
    facts = RunFacts(validity={"step_1": "bad", "step_2": "bad", "step_3": "bad"})
    plan = plan_prune(_listing(*_steps(1, 2, 3)), PrunePolicy(keep=1, grace=0), NOW, facts)
    assert plan.to_delete == [] and plan.findings[0].code == "nothing-deleted"


def test_last_copies_are_kept_and_not_ranked() -> None:
    listing = _listing(*_steps(1, 2), _entry("last.ckpt", 2),
                       _entry("nemo--step=2-last.ckpt", 2))
    plan = plan_prune(listing, PrunePolicy(keep=1, grace=0), NOW)
    assert [d.entry.name for d in plan.to_delete] == ["step_1"]
    assert all("last-copy" in d.protected_by for d in plan.decisions[2:])


@pytest.mark.parametrize("policy,fragment,param", [
    (PrunePolicy(), "say what to keep: keep N", "keep"),
    (PrunePolicy(keep=0), "^keep must be at least 1", "keep"),
    (PrunePolicy(keep_best=1), "^keep_best needs metric", "keep_best"),
    (PrunePolicy(keep=1, metric="x"), "^metric is used only with keep_best", "metric"),
    (PrunePolicy(keep=1, grace=-1), "^grace must be", "grace"),
    (PrunePolicy(older_than=0), "^older_than must be positive", "older_than"),
])
def test_policies_that_cannot_be_meant(policy: PrunePolicy, fragment: str, param: str) -> None:
    # The library names the policy's fields; the CLI words them as flags (test_prune.py).
    with pytest.raises(UsageError, match=fragment) as e:
        plan_prune(_listing(*_steps(1)), policy, NOW)
    assert e.value.param == param


# -- properties ----------------------------------------------------------------------------------

POINTER_NAMES = ("latest", "latest_checkpointed_iteration.txt", "last.ckpt")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[RunListing, PrunePolicy, RunFacts]:
    n = draw(st.integers(0, 12))
    entries = []
    step = 0
    for i in range(n):
        step += draw(st.integers(1, 700))
        entries.append(_entry(
            f"ck{i}", draw(st.one_of(st.none(), st.just(step))),
            bytes_=draw(st.integers(0, 1000)), age=draw(st.floats(0, 40 * DAY)),
            complete=draw(st.booleans() | st.just(True)),
            changed_age=draw(st.floats(-100, 40 * DAY)),
            metrics=draw(st.one_of(st.just({}), st.fixed_dictionaries(
                {"loss": st.floats(0, 10) | st.just(float("nan"))})))))
    if n and draw(st.booleans()):
        entries.append(_entry("last.ckpt", None))
    names = [e.name for e in entries]
    pointers = draw(st.dictionaries(st.sampled_from(POINTER_NAMES),
                                    st.sampled_from([*names, "gone"]) if names
                                    else st.just("gone"), max_size=2))
    listing = _listing(*entries, pointers=pointers)
    if draw(st.integers(0, 9)) == 0:
        listing.findings.append(Finding("warning", "pointer-unreadable", "cannot tell", "latest"))
    some = st.lists(st.sampled_from(names), unique=True) if names else st.just([])
    facts = RunFacts(
        validity={k: draw(st.sampled_from([None, "corrupt"])) for k in draw(some)},
        locks={k: f"{k}.lock" for k in draw(some)},
        pinned=dict.fromkeys(draw(some), "best_model_checkpoint"))
    rules = draw(st.lists(st.sampled_from(["keep", "keep_every", "keep_best", "older_than",
                                           "max_total_size"]), min_size=1, unique=True))
    values = {"keep": draw(st.integers(1, 5)), "keep_every": draw(st.integers(1, 900)),
              "keep_best": draw(st.integers(1, 3)), "older_than": draw(st.floats(1, 40 * DAY)),
              "max_total_size": draw(st.integers(1, 5000))}
    kwargs: dict[str, object] = {r: values[r] for r in rules}
    if "keep_best" in rules:
        kwargs.update(metric="loss", mode=draw(st.sampled_from(["min", "max"])))
    policy = PrunePolicy(grace=draw(st.sampled_from([0.0, 600.0])), **kwargs)  # type: ignore[arg-type]
    return listing, policy, facts


def _must_keep(listing: RunListing, policy: PrunePolicy, facts: RunFacts) -> set[str]:
    """The spec's never-delete list, computed independently of the planner."""
    if any(f.code == "pointer-unreadable" for f in listing.findings):
        return {e.name for e in listing.entries}
    ranked = [e for e in listing.entries if e.name != "last.ckpt"]
    keep = {"last.ckpt"} & {e.name for e in listing.entries}
    targets = [i for i, e in enumerate(ranked) if e.name in listing.pointers.values()]
    keep |= {e.name for e in ranked if e.name in listing.pointers.values()}
    if targets:
        keep |= {e.name for e in ranked[max(targets) + 1:]}
    keep |= {e.name for e in listing.entries if not e.complete}
    keep |= {e.name for e in listing.entries
             if NOW - e.changed < policy.grace or e.changed > NOW}
    keep |= set(facts.locks) | set(facts.pinned)
    valid = [e for e in ranked if e.complete and facts.validity.get(e.name) is None]
    if valid:
        keep.add(valid[-1].name)
    elif any(e.complete for e in ranked):
        keep |= {e.name for e in listing.entries}  # nothing validates: nothing goes
    return keep


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_never_deletes_what_must_be_kept(
        scenario: tuple[RunListing, PrunePolicy, RunFacts]) -> None:
    listing, policy, facts = scenario
    before = copy.deepcopy(listing)
    plan = plan_prune(listing, policy, NOW, facts)
    deleted = {d.entry.name for d in plan.to_delete}
    assert not deleted & _must_keep(listing, policy, facts)
    assert [d.entry.name for d in plan.decisions] == [e.name for e in listing.entries]
    for d in plan.decisions:
        assert d.delete == (not d.kept_by and not d.protected_by)
        assert d.reasons  # every decision says why
    assert listing == before  # pure: the input is untouched
    again = plan_prune(listing, policy, NOW, facts)
    assert [(d.delete, d.reasons) for d in again.decisions] == [
        (d.delete, d.reasons) for d in plan.decisions]


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_kept_set_is_a_superset_of_each_rules_keep_set(
        scenario: tuple[RunListing, PrunePolicy, RunFacts]) -> None:
    listing, policy, facts = scenario
    kept = {d.entry.name for d in plan_prune(listing, policy, NOW, facts).kept}
    single = {"keep": {"keep": policy.keep}, "keep-every": {"keep_every": policy.keep_every},
              "keep-best": {"keep_best": policy.keep_best, "metric": policy.metric,
                            "mode": policy.mode},
              "older-than": {"older_than": policy.older_than},
              "max-total-size": {"max_total_size": policy.max_total_size}}
    for rule in policy.rules():
        alone = PrunePolicy(grace=policy.grace, **single[rule])  # type: ignore[arg-type]
        alone_kept = {d.entry.name for d in plan_prune(listing, alone, NOW, facts).kept}
        assert alone_kept <= kept, rule


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_keep_n_keeps_the_newest_n(scenario: tuple[RunListing, PrunePolicy, RunFacts]) -> None:
    listing, policy, facts = scenario
    policy = dataclasses.replace(policy, keep=policy.keep or 2)
    kept = {d.entry.name for d in plan_prune(listing, policy, NOW, facts).kept}
    ranked = [e.name for e in listing.entries if e.name != "last.ckpt"]
    assert set(ranked[-(policy.keep or 0):]) <= kept


def test_keep_wording_for_an_uncounted_one_between_counted_ones() -> None:
    # Newest first: step_4 good, step_3 bad, step_2 good, step_1 good. --keep 2 counts step_4
    # and step_2; step_3 is older than step_4, one of the newest two, so it must not be called
    # "newer than the newest 2".
    entries = _steps(1, 2, 3, 4)
    facts = RunFacts(ledger=True, verdicts={"step_1": True, "step_2": True, "step_3": False,
                                            "step_4": True})
    plan = plan_prune(_listing(*entries), PrunePolicy(keep=2, grace=0), NOW, facts)
    by = {d.entry.name: d for d in plan.decisions}
    three = by["step_3"].reasons
    assert not by["step_3"].delete
    assert three[-1] == ("fewer than 2 complete ones are newer (`keep=2`); not counted: "
                         "its run ledger verdict is bad")
    assert not any("newer than the newest" in r for d in plan.decisions for r in d.reasons)
    assert by["step_2"].reasons[-1] == "newest 2 complete (`keep=2`)"
    assert by["step_1"].delete and "not among the newest 2 complete" in by["step_1"].reasons[-1]
