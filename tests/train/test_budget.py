"""Sizing a recipe by its budget (train/budget.py): the plan fills the budget with prompts first, then sampled
answers of those prompts, then epochs, never plans past it, and refuses a budget too small to train on,
naming one that is enough. The pipeline side (the probe, the plan kept across launches, training stopped at
the deadline) is in test_pipeline.py."""

import json

import pytest

from tsengine.errors import UserError
from tsengine.train.budget import (
    MAX_ANSWERS,
    MAX_EPOCH_FACTOR,
    SAMPLE_TEMPERATURE,
    SLACK,
    Plan,
    Rates,
    answers_per_prompt,
    fit_epochs,
    load,
    save,
    size,
    sized_regen,
)
from tsengine.train.recipe import Regen

RATES = Rates(regen_s_per_answer=2.0, tokens_per_answer=100.0, train_s_per_answer=0.5, eval_s=120.0, probe_s=30.0)


def _planned_s(plan) -> float:
    return sum(plan.expected_s.values())


def test_prompts_fill_the_budget_at_the_recipes_epochs():
    plan = size(3600, RATES, available_rows=10_000, epochs=3, val_rows=50)
    # an answer costs 2 s to regenerate and 3 x 0.5 s to train: (3600 * SLACK - 30 - 120 - 100) / 3.5 prompts
    assert plan.rows == int((3600 * SLACK - 30 - 120 - 50 * 2) / 3.5) and plan.epochs == 3 and plan.answers == 1
    assert plan.tokens == plan.rows * 100
    assert _planned_s(plan) <= 3600 * SLACK < _planned_s(plan) + 3.5  # one more prompt would not fit
    assert plan.train_deadline_s < 3600 - RATES.eval_s  # the eval still fits after the deadline
    assert plan.expected_s["regenerate"] + plan.expected_s["train"] + RATES.probe_s <= plan.train_deadline_s


def test_time_left_after_every_prompt_buys_answers_then_epochs():
    some = size(3600, RATES, available_rows=300, epochs=3, val_rows=10)
    # 300 prompts x 3.5 s = 1,050 s of the ~3,070 s to spend: 2 answers a prompt fit, 3 do not
    assert some.rows == 300 and some.answers == 2 and some.tokens == 300 * 2 * 100
    assert some.epochs > 3  # the time a third answer could not use buys epochs, to a tenth of one
    tenth = 0.1 * 300 * 2 * RATES.train_s_per_answer
    assert 3600 * SLACK - tenth < _planned_s(some) <= 3600 * SLACK
    few = size(3600, RATES, available_rows=100, epochs=2, val_rows=10)
    assert few.answers == MAX_ANSWERS and 2 < few.epochs <= 2 * MAX_EPOCH_FACTOR
    assert _planned_s(few) <= 3600 * SLACK
    tiny = size(3600, RATES, available_rows=5, epochs=2, val_rows=1)
    assert tiny.rows == 5 and tiny.answers == MAX_ANSWERS and tiny.epochs == 2 * MAX_EPOCH_FACTOR  # the caps stop it


def test_a_recipe_with_several_answers_is_sized_in_whole_prompts():
    plan = size(3600, RATES, available_rows=10_000, epochs=3, val_rows=50, answers=3)
    assert plan.answers == 3 and plan.rows == int((3600 * SLACK - 30 - 120 - 50 * 2) / (3 * 3.5))


def test_planned_answers_become_sampled_answers_of_the_same_prompts():
    greedy = Regen(temperature=0.0)
    assert answers_per_prompt(greedy) == 1 and sized_regen(greedy, 1) == greedy
    more = sized_regen(greedy, 3)
    assert (more.temperature, more.include_greedy, more.samples_per_prompt) == (SAMPLE_TEMPERATURE, True, 2)
    assert answers_per_prompt(more) == 3
    sampled = Regen(temperature=1.0, samples_per_prompt=2)  # the recipe's own temperature, no greedy answer
    assert answers_per_prompt(sampled) == 2
    assert sized_regen(sampled, 4).model_dump() == {**sampled.model_dump(), "samples_per_prompt": 4}


def test_a_plan_of_another_budget_or_an_older_version_is_made_anew(tmp_path):
    plan = size(3600, RATES, available_rows=300, epochs=3, val_rows=10)
    save(plan, RATES, tmp_path / "plan.json")
    assert load(tmp_path / "plan.json", 3600) == plan and load(tmp_path / "plan.json", 1800) is None
    saved = json.loads((tmp_path / "plan.json").read_text())
    del saved["plan"]["answers"]  # written before the field existed
    (tmp_path / "plan.json").write_text(json.dumps(saved))
    assert load(tmp_path / "plan.json", 3600) is None
    assert isinstance(plan, Plan)


def test_a_budget_too_small_is_refused_with_one_that_is_enough():
    with pytest.raises(UserError, match=r"budget_minutes=1: .*allowed: at least (\d+)") as e:
        size(60, RATES, available_rows=10_000, epochs=3, val_rows=50)
    enough = int(str(e.value).rsplit(" ", 1)[1])
    assert size(enough * 60, RATES, available_rows=10_000, epochs=3, val_rows=50).rows >= 8


def test_training_refits_to_the_time_left_never_past_the_plan():
    # 600 answers x 0.5 s = 300 s an epoch
    assert fit_epochs(3.0, RATES, 600, 3600) == 3.0  # time to spare: the plan holds
    assert fit_epochs(3.0, RATES, 600, 700) == 2.3  # regeneration ran over: 2.33 epochs fit, in tenths
    assert fit_epochs(3.0, RATES, 600, -5) == 0.1  # past the deadline already: the least training there is
