"""WebShop's reward for a purchase: how well the bought product and options match the goal.

Yao et al., "WebShop" (NeurIPS 2022), §3.1, and `get_reward` in the reference
implementation (web_agent_site/engine/goal.py). With U the goal (instruction) and Y the
purchase:

    R = r_type · (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price ≤ u_price])
               / (|U_att| + |U_opt| + 1)

following goal.py's functions rule for rule:

- `get_attribute_reward`: a goal attribute counts when one of the product's attributes
  matches it (token-set ratio > 85), or else when the goal attribute, as written, occurs
  in the lower-cased title, bullet points (features) or description;
- `get_option_reward`: every option value, bought and wanted, is first colour-normalised
  (`normalize_color` of normalize.py: the first of WebShop's 102 colour words it contains,
  substring match, in WebShop's order); then each *goal* option counts once when some
  bought option matches it (token-set ratio > 85). Sizes are matched like every other
  option, fuzzily; nothing is credited from the product's text;
- `get_type_reward`: r_type ∈ {0, 0.1, 0.5, 1} from the query, the category path and the
  overlap of the product's name with the goal product's name.

Each count is at most its denominator's term, so R lies in [0, 1].

The token-set ratio is thefuzz's `fuzz.token_set_ratio` exactly: thefuzz (0.20 on) is a
wrapper of rapidfuzz, and this is the same call (ASCII forced, rapidfuzz's default
processing, rounded to an int). One stand-in remains, because its dependency cannot be
had here: spaCy's English model (`en_core_web_sm`, which goal.py loads for its noun
tags) is not in the package registries, so `name_words` takes the content words of a
name (lowercase words that are not stop words) for spaCy's nouns. tests/test_webshop_reward.py
measures what that changes on WebShop's own test names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from gagpo.envs.external import require

FUZZY_THRESHOLD = 85  # a token-set ratio above this is a match (goal.py)

# normalize.py's COLOR_SET, in its order: `normalize_color` maps a value to the first
# colour word it contains.
COLOURS = [
    "alabaster",
    "apricot",
    "aqua",
    "ash",
    "asphalt",
    "azure",
    "banana",
    "beige",
    "black",
    "blue",
    "blush",
    "bordeaux",
    "bronze",
    "brown",
    "burgundy",
    "camel",
    "camo",
    "caramel",
    "champagne",
    "charcoal",
    "cheetah",
    "chestnut",
    "chocolate",
    "christmas",
    "coffee",
    "cognac",
    "copper",
    "coral",
    "cranberry",
    "cream",
    "crystal",
    "dark",
    "denim",
    "eggplant",
    "elephant",
    "espresso",
    "fuchsia",
    "gold",
    "granite",
    "grape",
    "graphite",
    "grass",
    "gray",
    "green",
    "grey",
    "heather",
    "indigo",
    "ivory",
    "ivy",
    "khaki",
    "lavender",
    "lemon",
    "leopard",
    "light",
    "lilac",
    "lime",
    "magenta",
    "maroon",
    "mauve",
    "merlot",
    "midnight",
    "mint",
    "mocha",
    "multicolor",
    "mushroom",
    "mustard",
    "natural",
    "navy",
    "nude",
    "olive",
    "orange",
    "peach",
    "pewter",
    "pink",
    "plum",
    "purple",
    "rainbow",
    "red",
    "rose",
    "royal",
    "rust",
    "sand",
    "sapphire",
    "seashell",
    "silver",
    "skull",
    "slate",
    "steel",
    "stone",
    "stonewash",
    "sunflower",
    "tan",
    "taupe",
    "teal",
    "tiger",
    "turquoise",
    "violet",
    "walnut",
    "wheat",
    "white",
    "wine",
    "yellow",
]

_STOP_WORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "as",
        "at",
        "by",
        "for",
        "from",
        "in",
        "into",
        "is",
        "it",
        "of",
        "on",
        "or",
        "pack",
        "set",
        "the",
        "to",
        "with",
        "without",
        "your",
        "you",
        "our",
        "this",
        "that",
        "these",
        "those",
    ]
)
_NON_ASCII = {i: None for i in range(128, 256)}  # thefuzz's utils.ascii_only


def normalize_color(value: str) -> str:
    """The first colour word contained in `value` (substring, as normalize.py does), else `value`."""
    return next((colour for colour in COLOURS if colour in value), value)


@cache
def _rapidfuzz() -> Any:
    require("rapidfuzz", "pip install 'rapidfuzz>=3'  (in the 'actors' extra)")
    from rapidfuzz import fuzz, utils

    return fuzz, utils


def token_set_ratio(a: str, b: str) -> int:
    """thefuzz's `fuzz.token_set_ratio(a, b)` (0-100): ASCII forced, rapidfuzz's default
    processing, rapidfuzz's token-set ratio, rounded."""
    fuzz, utils = _rapidfuzz()
    a = utils.default_process(str(a).translate(_NON_ASCII))
    b = utils.default_process(str(b).translate(_NON_ASCII))
    return int(round(fuzz.token_set_ratio(a, b)))  # noqa: RUF046 (thefuzz's own cast)


def name_words(name: str) -> set[str]:
    """Content words of a product name (the stand-in for spaCy's nouns, see the module doc)."""
    return {w for w in re.findall(r"[a-z]+", name.lower()) if len(w) > 1 and w not in _STOP_WORDS}


class Purchase(Protocol):
    """What the reward looks at of the bought product (webshop_data.Product has it)."""

    name: str  # the title
    query: str  # the search query the product was collected under
    product_category: str  # "Top › Middle › Leaf"
    attributes: tuple[str, ...]
    bullets: tuple[str, ...]  # the features
    description: str


class GoalSpec(Protocol):
    """What the reward looks at of the instruction's goal (webshop_data.Goal has it)."""

    name: str  # title of the product the instruction was written for
    query: str
    product_category: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]  # goal option values
    price_upper: float


@dataclass(frozen=True)
class Reward:
    """The reward and its parts (the reference's verbose info)."""

    total: float
    r_type: float
    attribute_matches: int
    option_matches: int
    price_ok: bool
    title_score: float


def type_reward(purchase: Purchase, goal: GoalSpec) -> tuple[float, float]:
    """(r_type, title_score): 1 when the type matches, 0.5 when only the name overlaps a
    little, 0.1 when it overlaps very little, 0 when the names share no word."""
    query_match = purchase.query == goal.query
    bought_path = {part.strip() for part in purchase.product_category.split("›")}
    goal_path = {part.strip() for part in goal.product_category.split("›")}
    category_match = len(bought_path & goal_path) >= 2
    desired = name_words(goal.name)
    title_score = len(name_words(purchase.name) & desired) / len(desired) if desired else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, title_score


def _mentioned(value: str, purchase: Purchase) -> bool:
    """Whether `value`, as written, occurs in the lower-cased title, bullet points or
    description (get_attribute_reward's fallback; attributes only)."""
    return (
        value in purchase.name.lower()
        or value in " ".join(purchase.bullets).lower()
        or value in purchase.description.lower()
    )


def attribute_matches(purchase: Purchase, goal_attributes: Iterable[str]) -> int:
    """goal.py `get_attribute_reward`: goal attributes found among the product's attributes
    (fuzzily) or, failing that, in its text."""
    matches = 0
    for wanted in goal_attributes:
        if any(
            token_set_ratio(have, wanted) > FUZZY_THRESHOLD for have in purchase.attributes
        ) or _mentioned(wanted, purchase):
            matches += 1
    return matches


def option_matches(goal_options: Iterable[str], chosen: Mapping[str, str]) -> int:
    """goal.py `get_option_reward`: goal options (each counted once) that some chosen
    option matches fuzzily, both sides colour-normalised."""
    bought = [normalize_color(v) for v in chosen.values()]
    wanted = [normalize_color(v) for v in goal_options]
    return sum(
        any(token_set_ratio(have, goal) > FUZZY_THRESHOLD for have in bought) for goal in wanted
    )


def reward(purchase: Purchase, goal: GoalSpec, price: float, chosen: Mapping[str, str]) -> Reward:
    """WebShop's reward (goal.py `get_reward`) for buying `purchase` at `price` with
    options `chosen` (option name -> value)."""
    r_type, title_score = type_reward(purchase, goal)
    n_att = attribute_matches(purchase, goal.attributes)
    n_opt = option_matches(goal.options, chosen)
    price_ok = price <= goal.price_upper
    total = r_type * (n_att + n_opt + price_ok) / (len(goal.attributes) + len(goal.options) + 1)
    return Reward(total, r_type, n_att, n_opt, price_ok, title_score)
