"""WebShop: pages and grammar, WebShop's reward against hand values, expert plans, state
keys, WebShop-format data files, and `gagpo-actors --env webshop` into valid shards."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.envs import make_env
from gagpo.envs.base import INVALID_ACTION_PENALTY
from gagpo.envs.webshop import WebShop, canonical, parse_command
from gagpo.envs.webshop_data import Goal, Product, generated_shop, load_shop
from gagpo.envs.webshop_reward import normalize_color, reward, token_set_ratio, type_reward
from gagpo.schemas.errors import GagpoError


def play(env: WebShop, commands: list[str]):
    transitions = [env.step(c) for c in commands]
    assert all(t.action_valid for t in transitions), commands
    return transitions


# -- reward arithmetic -------------------------------------------------------------------


def product(**overrides) -> Product:
    fields = dict(
        asin="B00-01",
        name="Acme Gluten Free Coffee - Low Calorie",
        query="coffee",
        category="grocery",
        product_category="Grocery & Gourmet Food › Pantry › Coffee",
        attributes=("gluten free", "low calorie"),
        bullets=("Gluten free.", "Low calorie."),
        description="Coffee by Acme.",
        options={"flavor": ("hazelnut", "caramel"), "size": ("pack of 2", "pack of 6")},
        price_tag="$19.99",
        price=19.99,
    )
    return Product(**{**fields, **overrides})


GOAL = Goal(
    asin="B00-01",
    instruction="i need gluten free and non gmo coffee with hazelnut flavor and pack of 6 size",
    name="Acme Gluten Free Coffee - Low Calorie",
    query="coffee",
    product_category="Grocery & Gourmet Food › Pantry › Coffee",
    attributes=("gluten free", "non gmo"),
    options=("hazelnut", "pack of 6"),
    price_upper=30.0,
)


def test_token_set_ratio_and_colour_normalisation():
    assert token_set_ratio("x-large", "large") == 100  # the shared words alone match fully
    assert token_set_ratio("Gluten-Free", "gluten free") == 100
    # "abc" vs "abd": LCS 2 of 6 characters -> round(100 * 4 / 6) = 67
    assert token_set_ratio("abc", "abd") == 67
    assert token_set_ratio("", "abc") == 0
    assert normalize_color("light navy blue") == "blue"  # the first colour of the list found
    assert normalize_color("hazelnut") == "hazelnut"


def test_partial_purchases_get_webshop_partial_reward():
    # Right product, goal options chosen, price under the bound: only "non gmo" is missing.
    # (1 attribute + 2 options + price) / (2 attributes + 2 options + 1) = 4/5
    full = reward(product(), GOAL, 19.99, {"flavor": "hazelnut", "size": "pack of 6"})
    assert full.total == pytest.approx(4 / 5)
    assert (full.attribute_matches, full.option_matches, full.price_ok) == (1, 2, True)
    # Wrong flavour and over the price bound: (1 + 1 + 0) / 5. (A wrong size would not
    # do: WebShop matches sizes fuzzily, "pack of 2" ~ "pack of 6"; test_webshop_reward.py.)
    wrong = reward(product(), GOAL, 35.0, {"flavor": "caramel", "size": "pack of 6"})
    assert wrong.total == pytest.approx(2 / 5)
    # No option chosen at all: (1 + 0 + 1) / 5
    assert reward(product(), GOAL, 19.99, {}).total == pytest.approx(2 / 5)
    # An attribute found only in the description counts: (2 + 2 + 1) / 5 = 1
    described = product(description="Coffee by Acme, non gmo beans.")
    assert reward(described, GOAL, 19.99, {"flavor": "hazelnut", "size": "pack of 6"}).total == 1.0


def test_type_reward_scales_with_name_overlap():
    # Same query: r_type 1 whatever the name overlap above 0.1.
    assert type_reward(product(), GOAL) == (1.0, 1.0)
    # Other query and category; name words {acme, gluten, free, coffee, low, calorie}:
    # "Acme Green Tea" shares 1 of 6 -> title_score 1/6 <= 0.2 and no match -> 0.5.
    tea = product(name="Acme Green Tea", query="tea", product_category="Grocery › Drinks › Tea")
    assert type_reward(tea, GOAL) == (0.5, pytest.approx(1 / 6))
    # No shared word -> 0: the whole reward is 0 whatever else matches.
    other = product(name="Zephyr Desk", query="desk", product_category="Home › Furniture › Desk")
    assert reward(other, GOAL, 1.0, {"flavor": "hazelnut", "size": "pack of 6"}).total == 0.0


# -- the environment on the generated catalog ------------------------------------------------


def test_catalog_is_a_few_hundred_products_across_five_categories():
    shop = generated_shop(0)
    assert len(shop.products) == 300 and len(shop.by_asin) == 300
    assert {p.category for p in shop.products} == {
        "fashion",
        "beauty",
        "grocery",
        "furniture",
        "electronics",
    }
    assert all(p.attributes and p.options and p.price > 0 for p in shop.products)
    assert generated_shop(0) is shop and generated_shop(1).products != shop.products


def test_expert_plans_reach_reward_one_and_win_only_at_the_end():
    env = WebShop()
    for seed in range(40):
        env.reset(seed)
        plan = env.expert_plan()
        assert plan and plan[0].startswith("search[") and plan[-1] == "click[buy now]"
        steps = play(env, plan)
        assert [t.reward for t in steps[:-1]] == [0.0] * (len(steps) - 1)
        assert steps[-1].reward == 1.0 and steps[-1].done and steps[-1].won
        assert not any(t.won or t.done for t in steps[:-1])
        assert steps[-1].next_state_key is None and steps[-1].admissible == ()


def test_buying_without_options_earns_the_partial_reward():
    env = WebShop()
    env.reset(5)
    plan = env.expert_plan()
    goal = env.goal
    without_options = [
        plan[0],
        *[c for c in plan if re.fullmatch(r"click\[b\d\d-\d\d\]", c)],
        plan[-1],
    ]
    last = play(env, without_options)[-1]
    # Generated titles, features and descriptions never name option values, so no option
    # matches; every goal attribute is the product's, and the price is under the bound.
    n_att, n_opt = len(goal.attributes), len(goal.options)
    assert (n_att, n_opt) == (1, 2)
    assert last.reward == pytest.approx((n_att + 0 + 1) / (n_att + n_opt + 1))
    assert last.done and not last.won


def test_pages_grammar_and_navigation():
    env = WebShop()
    first = env.reset(3)
    assert first.observation.startswith("WebShop [SEP] Instruction: [SEP] ")
    assert first.admissible == ("search[<your query>]",) and first.state_key == "search"
    results = env.step("Action: search [ gluten free coffee ]")
    assert results.action_valid and results.reward == 0.0
    assert "Page 1 (Total results: 50)" in results.observation
    assert results.next_state_key == "results query='gluten free coffee' page=1"
    assert "click[next >]" in results.admissible and "click[< prev]" not in results.admissible
    page2 = env.step("click[next >]")
    assert page2.next_state_key.endswith("page=2") and "click[< prev]" in page2.admissible
    item = next(a for a in page2.admissible if re.fullmatch(r"click\[b\d\d-\d\d\]", a))
    on_item = env.step(item.replace("[", " [ ").upper())  # case and spacing do not matter
    assert on_item.action_valid and "Buy Now" in on_item.observation
    assert {"click[description]", "click[features]", "click[reviews]"} <= set(on_item.admissible)
    key_item = on_item.next_state_key
    features = env.step("click[features]")
    assert features.next_state_key.startswith("features ")
    back = env.step("click[< prev]")
    assert back.next_state_key == key_item  # the same page is the same state, whatever the path
    assert env.step("click[< prev]").next_state_key == page2.next_state_key
    assert env.step("click[back to search]").next_state_key == "search"


def test_invalid_replies_cost_the_penalty_and_change_nothing():
    env = WebShop(max_turns=5)
    env.reset(0)
    bad = env.step("click[buy now]")  # nothing to click on the search page
    assert not bad.action_valid and bad.reward == INVALID_ACTION_PENALTY
    assert bad.state_key == bad.next_state_key == "search"
    assert not env.step("search[]").action_valid  # empty query
    env.step("search[coffee]")
    assert not env.step("search[tea]").action_valid  # no search bar on a results page
    last = env.step("I would like to buy something")
    assert not last.action_valid and last.truncated and not last.done and not last.won


def test_state_key_has_options_but_no_history_and_search_resets_options():
    env = WebShop()
    env.reset(8)
    plan = env.expert_plan()
    steps = play(env, plan[:-1])  # everything but buying
    key = steps[-1].next_state_key
    assert "options=" in key and key.split("options=")[1]  # the chosen options are in it
    again = WebShop()
    again.reset(8)
    detour = [plan[0], "click[back to search]", *plan]  # a longer path to the same page
    assert play(again, detour[:-1])[-1].next_state_key == key
    assert again.step("click[back to search]").next_state_key == "search"
    assert play(again, [plan[0]])[-1].next_state_key == steps[0].next_state_key


def test_parse_command_and_canonical_text():
    assert parse_command("I think: click [ Buy Now ]") == ("click", "Buy Now")
    assert parse_command("search[red shirt") == ("search", "red shirt")  # unclosed at the end
    assert parse_command("buy it") is None
    assert canonical("B03-17") == canonical("b03 - 17") == "b03 - 17"


def test_vocabulary_is_bounded_and_spells_every_command():
    vocabulary = set(WebShop.vocabulary())
    assert len(vocabulary) == 159
    rng = random.Random(0)
    env = WebShop(max_turns=1000)
    for seed in range(15):
        tr = env.reset(seed)
        commands = set(env.expert_plan() or ()) | set(tr.admissible or ())
        for _ in range(12):  # a random walk through the pages
            options = [a for a in tr.admissible or () if a != "click[buy now]"]
            choice = rng.choice(options)
            if choice.startswith("search["):
                choice = env.expert_plan()[0]
            tr = env.step(choice)
            commands |= set(tr.admissible or ())
        for command in commands:
            assert set(re.findall(r"\w+", command.lower())) <= vocabulary, command


def test_registry_builds_webshop_with_options():
    env = make_env("webshop", 9, catalog_seed=2)
    assert isinstance(env, WebShop) and env.max_turns == 9
    with pytest.raises(
        GagpoError, match="takes no option 'colour'; accepted: data_dir, catalog_seed"
    ):
        make_env("webshop", 9, colour="red")
    with pytest.raises(GagpoError, match="catalog_seed must be an integer >= 0"):
        make_env("webshop", 9, catalog_seed=-1)


# -- WebShop's own files ---------------------------------------------------------------------


def write_webshop_folder(folder: Path) -> Path:
    """Three products and two human instructions in WebShop's file formats."""
    folder.mkdir(parents=True, exist_ok=True)
    products = [
        {
            "asin": "B07XYZ1234",
            "name": "Bright Citrus Deodorant by Earth Mama",
            "full_description": "Natural deodorant for sensitive skin.",
            "small_description": ["Aluminum free", "Made with essential oils"],
            "pricing": "$10.99",
            "customization_options": {
                "Scent": [{"value": "Citrus", "image": None}, {"value": "Lavender", "image": None}],
                "Size": [{"value": "3 Ounce (Pack of 1)"}, {"value": "3 Ounce (Pack of 2)"}],
            },
            "category": "beauty",
            "query": "deodorant",
            "product_category": "Beauty & Personal Care › Personal Care › Deodorants",
            "images": ["x.jpg"],
        },
        {
            "asin": "B08ABC0001",
            "name": "Ginger Fresh Deodorant for Men",
            "full_description": "Long lasting freshness.",
            "small_description": "Aluminum free formula",
            "pricing": "$8.00 - $12.00",
            "customization_options": None,
            "category": "beauty",
            "query": "deodorant",
            "product_category": "Beauty & Personal Care › Personal Care › Deodorants",
            "images": ["y.jpg"],
        },
        {
            "asin": "B09TEA0002",
            "name": "Organic Green Tea Bags",
            "full_description": "Green tea from organic farms.",
            "small_description": ["Organic", "100 count"],
            "pricing": "",
            "customization_options": {"Flavor Name": [{"value": "Mint"}, {"value": "Lemon"}]},
            "category": "grocery",
            "query": "green tea",
            "product_category": "Grocery & Gourmet Food › Beverages › Tea",
            "images": ["z.jpg"],
        },
    ]
    attributes = {
        "B07XYZ1234": {"attributes": ["aluminum free", "sensitive skin"]},
        "B08ABC0001": {"attributes": ["long lasting"]},
        "B09TEA0002": {"attributes": ["organic"]},
    }
    human = {
        "B07XYZ1234": [
            {
                "asin": "B07XYZ1234",
                "instruction": "i want an aluminum free deodorant for sensitive skin in citrus scent.",
                "instruction_attributes": ["aluminum free", "sensitive skin"],
                "instruction_options": ["citrus", "3 ounce (pack of 1)"],
            }
        ],
        "B09TEA0002": [
            {
                "asin": "B09TEA0002",
                "instruction": "i need organic green tea bags with mint flavor",
                "instruction_attributes": ["organic"],
                "instruction_options": ["mint"],
            },
            {  # no attributes: skipped, as WebShop does
                "asin": "B09TEA0002",
                "instruction": "tea please",
                "instruction_attributes": [],
                "instruction_options": [],
            },
        ],
    }
    (folder / "items_shuffle_1000.json").write_text(json.dumps(products))
    (folder / "items_ins_v2_1000.json").write_text(json.dumps(attributes))
    (folder / "items_human_ins.json").write_text(json.dumps(human))
    return folder


def test_webshop_files_load_and_play(tmp_path: Path):
    folder = write_webshop_folder(tmp_path / "data")
    shop = load_shop(str(folder))
    assert [p.asin for p in shop.products] == ["B07XYZ1234", "B08ABC0001", "B09TEA0002"]
    deodorant = shop.by_asin["B07XYZ1234"]
    assert deodorant.options == {
        "scent": ("citrus", "lavender"),
        "size": ("3 ounce (pack of 1)", "3 ounce (pack of 2)"),
    }
    assert shop.by_asin["B08ABC0001"].price_tag == "$8.0 to $12.0"
    assert shop.by_asin["B08ABC0001"].price == 11.498495793404526  # drawn in it, seeded by the id
    assert shop.by_asin["B09TEA0002"].price == 100.0  # no pricing: WebShop's $100
    assert len(shop.goals) == 2
    env = WebShop(data_dir=str(folder))
    first = env.reset(0)
    assert "aluminum free deodorant" in first.observation
    assert "price lower than" in first.observation  # the price bound is appended
    plan = env.expert_plan()
    assert plan == [
        "search[bright citrus deodorant by earth mama]",
        "click[b07xyz1234]",
        "click[citrus]",
        "click[3 ounce (pack of 1)]",
        "click[buy now]",
    ]
    last = play(env, plan)[-1]
    assert last.reward == 1.0 and last.won
    env.reset(1)  # the tea goal: one option, bought without it -> (1 + 0 + 1) / 3
    last = play(env, ["search[green tea]", "click[b09tea0002]", "click[buy now]"])[-1]
    assert last.reward == pytest.approx(2 / 3) and not last.won


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "items_shuffle_1000.json").write_text("[{"), "is not valid JSON"),
        (
            lambda d: (d / "items_shuffle_1000.json").write_text('[{"name": "x"}]'),
            "product 0 has no 'asin'",
        ),
        (
            lambda d: (d / "items_shuffle_1000.json").write_text('{"a": 1}'),
            "expected a list of products",
        ),
        (lambda d: (d / "items_human_ins.json").unlink(), "has no items_human_ins.json"),
        (lambda d: (d / "items_human_ins.json").write_text("{}"), "no instruction with attributes"),
        (
            lambda d: (d / "items_ins_v2_1000.json").write_text(
                '{"B07XYZ1234": {"attributes": "x"}}'
            ),
            "B07XYZ1234: expected an object with an 'attributes' list",
        ),
    ],
    ids=["not-json", "no-asin", "not-a-list", "no-instructions", "no-goals", "bad-attributes"],
)
def test_bad_webshop_files_name_the_file_and_the_problem(tmp_path: Path, breakage, message):
    folder = write_webshop_folder(tmp_path / "data")
    breakage(folder)
    with pytest.raises(GagpoError, match=re.escape(message)) as info:
        WebShop(data_dir=str(folder))
    assert str(folder) in str(info.value)


ACTORS = [sys.executable, "-m", "gagpo.actors.cli", "--quiet"]


def test_bad_webshop_files_are_one_line_and_exit_2(tmp_path: Path, store_dir: Path):
    folder = write_webshop_folder(tmp_path / "data")
    (folder / "items_shuffle_1000.json").write_text('[{"asin": "B1", "name": 3}]')
    result = subprocess.run(
        [
            *ACTORS,
            "--store",
            str(store_dir),
            "--env",
            "webshop",
            "--set",
            f"env_options.data_dir={folder}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "items_shuffle_1000.json" in lines[0] and "'name' must be str" in lines[0]


def test_replan_finishes_the_task_after_random_detours():
    rng = random.Random(3)
    env = WebShop(max_turns=1000)
    for seed in range(30):
        tr = env.reset(seed)
        for _ in range(rng.randint(1, 8)):  # a detour of random clicks (never buying)
            options = [a for a in tr.admissible if a != "click[buy now]"]
            choice = rng.choice(options)
            tr = env.step(env.expert_plan()[0] if choice.startswith("search[") else choice)
        steps = play(env, env.replan())
        assert steps[-1].won and steps[-1].reward == 1.0, seed
