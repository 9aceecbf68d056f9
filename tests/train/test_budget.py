"""Sizing a recipe by its budget (train/budget.py): the plan fills the budget with rows first, then epochs,
never plans past it, and refuses a budget too small to train on, naming one that is enough. The pipeline
side (the probe, the plan kept across launches, training stopped at the deadline) is in test_pipeline.py."""

import pytest

from tsengine.errors import UserError
from tsengine.train.budget import MAX_EPOCH_FACTOR, SLACK, Rates, size

RATES = Rates(regen_s_per_row=2.0, tokens_per_row=100.0, train_s_per_row=0.5, eval_s=120.0, probe_s=30.0)


def _planned_s(plan) -> float:
    return sum(plan.expected_s.values())


def test_rows_fill_the_budget_at_the_recipes_epochs():
    plan = size(3600, RATES, available_rows=10_000, epochs=3, val_rows=50)
    # a row costs 2 s to regenerate and 3 x 0.5 s to train: (3600 * SLACK - 30 - 120 - 100) / 3.5 rows
    assert plan.rows == int((3600 * SLACK - 30 - 120 - 50 * 2) / 3.5) and plan.epochs == 3
    assert _planned_s(plan) <= 3600 * SLACK < _planned_s(plan) + 3.5  # one more row would not fit
    assert plan.train_deadline_s < 3600 - RATES.eval_s  # the eval still fits after the deadline
    assert plan.expected_s["regenerate"] + plan.expected_s["train"] + RATES.probe_s <= plan.train_deadline_s


def test_time_left_after_every_row_buys_epochs_up_to_a_cap():
    few = size(3600, RATES, available_rows=100, epochs=2, val_rows=10)
    assert few.rows == 100 and 2 < few.epochs <= 2 * MAX_EPOCH_FACTOR
    assert _planned_s(few) <= 3600 * SLACK
    tiny = size(3600, RATES, available_rows=5, epochs=2, val_rows=1)
    assert tiny.rows == 5 and tiny.epochs == 2 * MAX_EPOCH_FACTOR  # the cap, not the hour, stops it


def test_a_budget_too_small_is_refused_with_one_that_is_enough():
    with pytest.raises(UserError, match=r"budget_minutes=1: .*allowed: at least (\d+)") as e:
        size(60, RATES, available_rows=10_000, epochs=3, val_rows=50)
    enough = int(str(e.value).rsplit(" ", 1)[1])
    assert size(enough * 60, RATES, available_rows=10_000, epochs=3, val_rows=50).rows >= 8
