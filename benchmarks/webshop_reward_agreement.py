"""Agreement of envs/webshop_reward.py with WebShop's own `get_reward`.

WebShop's code is not part of this project: the harness runs `goal.py` and
`normalize.py` unmodified from a copy kept outside the repository, e.g.

    mkdir -p /tmp/webshop/web_agent_site/engine
    git --git-dir=<clone of princeton-nlp/WebShop> show HEAD:web_agent_site/engine/goal.py \\
        > /tmp/webshop/web_agent_site/engine/goal.py      # and the same for normalize.py
    .venv/bin/pip install --no-deps --target /tmp/webshop/site thefuzz==0.22.1
    .venv/bin/python benchmarks/webshop_reward_agreement.py --webshop /tmp/webshop

goal.py imports thefuzz (installed above, outside the venv; it runs on the venv's
rapidfuzz), rich (in the venv) and spaCy with its English model. That model is not in
the package registries, so `spacy` is the one module replaced: its `load` returns a
tagger that marks the project's stand-in words (`name_words`: content words) as nouns.
Both sides therefore share that stand-in, which tests/test_webshop_reward.py measures
against spaCy's scores in WebShop's own tests; everything else is WebShop's code.

Cases: for each of 3 catalog seeds, 40 generated goals (as the environment draws them)
× 6 kinds of purchase (the goal product with the goal options; with other options;
with none; another product of the same type; any product; the goal product over the
price bound), plus a hand-made grid of size and colour options on one product.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from gagpo.envs.webshop_data import Goal, Product, generated_goal, generated_shop
from gagpo.envs.webshop_reward import name_words, reward

SEEDS = (0, 1, 2)
GOALS_PER_SEED = 40
KINDS = ("expert", "other_options", "no_options", "same_type", "any_product", "over_price")
HAND_VALUES = [
    "small",
    "x-small",
    "large",
    "x-large",
    "XL",
    "king",
    "california king",
    "pack of 2",
    "pack of 6",
    "9",
    "9.5",
    "navy blue",
    "light blue",
    "dark grey",
    "dark green",
    "maroon red",
    "standard",
    "deluxe",
]


@dataclass
class Case:
    source: str
    kind: str
    purchase: Product
    goal: Goal
    price: float
    chosen: dict[str, str]


def _spacy_stand_in() -> types.ModuleType:
    """A `spacy` module whose English "model" tags the stand-in's words as nouns."""

    class Token:
        def __init__(self, text: str) -> None:
            self.text, self.pos_ = text, "NOUN"

    def load(_name: str):
        return lambda text: [Token(w) for w in sorted(name_words(text))]

    module = types.ModuleType("spacy")
    module.load = load  # type: ignore[attr-defined]
    return module


def load_webshop_goal(webshop: Path, site: Path | None) -> types.ModuleType:
    if not (webshop / "web_agent_site" / "engine" / "goal.py").is_file():
        raise SystemExit(f"no web_agent_site/engine/goal.py under {webshop} (see the docstring)")
    sys.path[:0] = [str(webshop)] + ([str(site)] if site else [])
    sys.modules["spacy"] = _spacy_stand_in()
    from web_agent_site.engine import goal  # WebShop's own, unmodified

    return goal


def _random_options(product: Product, rng: random.Random) -> dict[str, str]:
    return {name: rng.choice(values) for name, values in product.options.items()}


def generated_cases() -> list[Case]:
    cases = []
    for seed in SEEDS:
        shop = generated_shop(seed)
        rng = random.Random(f"agreement-{seed}")
        for task in range(GOALS_PER_SEED):
            goal, _ = generated_goal(shop, task)
            target = shop.by_asin[goal.asin]
            wanted = dict(zip(target.options, goal.options, strict=True))
            same_type = [p for p in shop.products if p.query == target.query and p is not target]
            other = {
                name: rng.choice([v for v in values if v != wanted[name]] or list(values))
                for name, values in target.options.items()
            }
            picks = {
                "expert": (target, wanted, target.price),
                "other_options": (target, other, target.price),
                "no_options": (target, {}, target.price),
                "same_type": (p := rng.choice(same_type), _random_options(p, rng), p.price),
                "any_product": (q := rng.choice(shop.products), _random_options(q, rng), q.price),
                "over_price": (target, _random_options(target, rng), goal.price_upper + 5.0),
            }
            for kind in KINDS:
                purchase, chosen, price = picks[kind]
                cases.append(Case(f"seed {seed}", kind, purchase, goal, price, chosen))
    return cases


def hand_cases() -> list[Case]:
    """Every pair of a grid of size and colour values, as goal option and bought option."""
    shop = generated_shop(0)
    target = shop.products[0]
    cases = []
    for wanted in HAND_VALUES:
        for bought in HAND_VALUES:
            goal = Goal(
                asin=target.asin,
                instruction="",
                name=target.name,
                query=target.query,
                product_category=target.product_category,
                attributes=target.attributes[:1],
                options=(wanted,),
                price_upper=1000.0,
            )
            cases.append(Case("hand", "option grid", target, goal, target.price, {"size": bought}))
    return cases


def webshop_reward(goal_module: types.ModuleType, case: Case) -> float:
    p, g = case.purchase, case.goal
    purchased = {
        "query": p.query,
        "product_category": p.product_category,
        "name": p.name,
        "Attributes": list(p.attributes),
        "Title": p.name,
        "BulletPoints": list(p.bullets),
        "Description": p.description,
    }
    goal = {
        "query": g.query,
        "product_category": g.product_category,
        "name": g.name,
        "attributes": list(g.attributes),
        "goal_options": list(g.options),
        "price_upper": g.price_upper,
    }
    return float(goal_module.get_reward(purchased, goal, case.price, dict(case.chosen)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--webshop", type=Path, required=True, help="folder holding web_agent_site/engine/goal.py"
    )
    parser.add_argument(
        "--site", type=Path, default=Path("/tmp/webshop/site"), help="where thefuzz is installed"
    )
    parser.add_argument("--json", type=Path, help="write the per-case results here")
    args = parser.parse_args()
    goal_module = load_webshop_goal(args.webshop, args.site if args.site.is_dir() else None)
    import thefuzz

    rows = []
    for case in generated_cases() + hand_cases():
        ours = reward(case.purchase, case.goal, case.price, case.chosen).total
        theirs = webshop_reward(goal_module, case)
        rows.append(
            {
                "source": case.source,
                "kind": case.kind,
                "ours": ours,
                "webshop": theirs,
                "agree": abs(ours - theirs) < 1e-9,
                "chosen": case.chosen,
                "goal_options": list(case.goal.options),
            }
        )
    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row)
    agree = sum(r["agree"] for r in rows)
    print(f"thefuzz from {Path(thefuzz.__file__).parent}; WebShop's goal.py from {args.webshop}")
    print("| kind | cases | exact | max |diff| | mean reward (WebShop) |")
    print("|---|---|---|---|---|")
    for kind, group in by_kind.items():
        diff = max(abs(r["ours"] - r["webshop"]) for r in group)
        mean = sum(r["webshop"] for r in group) / len(group)
        print(
            f"| {kind} | {len(group)} | {sum(r['agree'] for r in group)} | {diff:.4f} | {mean:.3f} |"
        )
    print(f"| all | {len(rows)} | {agree} ({agree / len(rows):.2%}) | | |")
    above = [r for r in rows if r["ours"] > 1 or r["webshop"] > 1]
    print(
        f"rewards above 1: {len(above)}; ones on one side only: "
        f"{sum((r['ours'] == 1) != (r['webshop'] == 1) for r in rows)}"
    )
    for r in [r for r in rows if not r["agree"]][:10]:
        print("disagree:", json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
