"""WebShop's products, goals and search engine: generated from a seed, or read from
WebShop's own JSON files.

Two sources give the same `Shop` (products, a BM25 search engine, goals):

- `generated_shop(seed)`: a catalog of 300 products in WebShop's five categories
  (fashion, beauty, grocery, furniture, electronics), each with attributes, options
  (colour, size, scent, flavor, ...), a price, features, a description and reviews;
  goals are drawn per task seed (`generated_goal`) the way WebShop makes its
  instructions: a product, some of its attributes, one value per option, and a price
  bound a little above its price.
- `load_shop(data_dir)`: WebShop's data folder (`items_shuffle_1000.json` or
  `items_shuffle.json`, `items_ins_v2_1000.json` or `items_ins_v2.json`,
  `items_human_ins.json`, optionally `reviews.json`), read as its `load_products` and
  `get_human_goals` read them; task seed k plays goal k (modulo their number).

Generated words are drawn from small fixed lists and product ids are two vocabulary
words joined by "-" ("B03-17"), so every command the environment takes is spelled with
a few hundred words (`vocabulary()`), which the tiny word-level policy needs.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from gagpo.schemas.errors import GagpoError

SEARCH_RETURN_N = 50  # results a search returns (WebShop's SEARCH_RETURN_N)
PRODUCT_WINDOW = 10  # results per page
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # price bounds an instruction may use
NO_PRICE_BOUND = 1_000_000.0
BM25_K1, BM25_B = 0.9, 0.4  # pyserini's defaults, which WebShop's Lucene index uses

PRODUCT_FILES = ("items_shuffle_1000.json", "items_shuffle.json")
ATTRIBUTE_FILES = ("items_ins_v2_1000.json", "items_ins_v2.json")
HUMAN_GOALS_FILE = "items_human_ins.json"
REVIEWS_FILE = "reviews.json"


@dataclass(frozen=True)
class Product:
    asin: str  # upper case; clicked in lower case
    name: str  # the title
    query: str
    category: str
    product_category: str
    attributes: tuple[str, ...]
    bullets: tuple[str, ...]  # "Features"
    description: str
    options: dict[str, tuple[str, ...]]  # option name -> values, in page order
    price_tag: str  # "$12.99" or "$10.0 to $20.0"
    price: float  # the price it sells at (drawn in a price range, as WebShop does)
    reviews: tuple[tuple[float, str], ...] = ()  # (score, text)

    @property
    def rating(self) -> str:
        if not self.reviews:
            return "N.A."
        return f"{sum(score for score, _ in self.reviews) / len(self.reviews):.1f}"


@dataclass(frozen=True)
class Goal:
    asin: str  # the product the instruction was written for
    instruction: str
    name: str
    query: str
    product_category: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]  # goal option values
    price_upper: float


def words(text: str) -> list[str]:
    """Lower-case alphanumeric words: how queries and documents are tokenised."""
    return re.findall(r"[a-z0-9]+", text.lower())


class SearchEngine:
    """BM25 over each product's title, description, features and option values (the
    fields of WebShop's Lucene index); a query returns the top SEARCH_RETURN_N products
    that share a word with it, best first, ties in catalog order."""

    def __init__(self, products: list[Product]) -> None:
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.lengths: list[int] = []
        for i, p in enumerate(products):
            text = " ".join(
                [p.name, p.description, *p.bullets, *(v for vs in p.options.values() for v in vs)]
            )
            counts = Counter(words(text))
            self.lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self.postings[term].append((i, tf))
        self.average_length = sum(self.lengths) / max(len(self.lengths), 1)

    def search(self, query: str) -> list[int]:
        n = len(self.lengths)
        scores: dict[int, float] = defaultdict(float)
        for term in set(words(query)):
            postings = self.postings.get(term, [])
            idf = math.log(1 + (n - len(postings) + 0.5) / (len(postings) + 0.5))
            for i, tf in postings:
                norm = BM25_K1 * (1 - BM25_B + BM25_B * self.lengths[i] / self.average_length)
                scores[i] += idf * tf * (BM25_K1 + 1) / (tf + norm)
        ranked = sorted(scores, key=lambda i: (-scores[i], i))
        return ranked[:SEARCH_RETURN_N]


@dataclass
class Shop:
    products: list[Product]
    goals: list[Goal] | None  # None: goals are generated per task seed
    source: str  # "generated (seed N)" or the data folder
    by_asin: dict[str, Product] = field(init=False)
    engine: SearchEngine = field(init=False)

    def __post_init__(self) -> None:
        self.by_asin = {p.asin: p for p in self.products}
        self.engine = SearchEngine(self.products)

    def search(self, query: str) -> list[Product]:
        return [self.products[i] for i in self.engine.search(query)]


def price_bound(price: float, rng: random.Random) -> float:
    """WebShop's instruction price bound: the larger of two of the next four multiples of ten."""
    above = [p for p in PRICE_RANGE if p > price][:4]
    return sorted(rng.sample(above, 2))[1] if len(above) >= 2 else NO_PRICE_BOUND


def price_text(price_upper: float) -> str:
    return (
        f", and price lower than {price_upper:.2f} dollars" if price_upper < NO_PRICE_BOUND else ""
    )


# -- the generated catalog -------------------------------------------------------------


@dataclass(frozen=True)
class _Category:
    name: str
    path: str  # product_category prefix; the product type is appended
    types: tuple[str, ...]
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    prices: tuple[float, float]
    blurbs: tuple[str, ...]  # description sentences: no attribute or option words in them


CATEGORIES = (
    _Category(
        "fashion",
        "Clothing, Shoes & Jewelry › Fashion",
        ("shirt", "dress", "jacket", "sneakers", "hoodie"),
        ("machine wash", "slim fit", "long sleeve", "quick drying", "relaxed fit", "stretch"),
        {
            "color": ("black", "white", "navy", "red", "grey", "green"),
            "size": ("small", "medium", "large", "x-large"),
        },
        (12.0, 80.0),
        ("Made to be worn every day.", "A wardrobe staple for any season."),
    ),
    _Category(
        "beauty",
        "Beauty & Personal Care › Skin & Hair",
        ("shampoo", "lotion", "lipstick", "perfume", "serum"),
        (
            "paraben free",
            "long lasting",
            "cruelty free",
            "sensitive skin",
            "travel size",
            "dermatologist tested",
        ),
        {
            "scent": ("lavender", "vanilla", "coconut", "unscented", "citrus"),
            "size": ("2 ounce", "8 ounce", "16 ounce"),
        },
        (6.0, 45.0),
        ("Part of a simple daily routine.", "Gentle enough to use every day."),
    ),
    _Category(
        "grocery",
        "Grocery & Gourmet Food › Pantry",
        ("coffee", "tea", "cookies", "chocolate", "granola"),
        ("gluten free", "sugar free", "non gmo", "low calorie", "high protein", "keto friendly"),
        {
            "flavor": ("hazelnut", "caramel", "original", "cinnamon", "mocha", "honey"),
            "size": ("pack of 2", "pack of 6", "12 count"),
        },
        (4.0, 35.0),
        ("Enjoy it at home or on the go.", "A pantry favourite for breakfast and snacks."),
    ),
    _Category(
        "furniture",
        "Home & Kitchen › Furniture",
        ("chair", "desk", "bookshelf", "nightstand", "ottoman"),
        (
            "easy assembly",
            "solid wood",
            "storage space",
            "living room",
            "space saving",
            "heavy duty",
        ),
        {"color": ("white", "black", "walnut", "grey", "oak")},
        (30.0, 250.0),
        ("Fits in any room of the house.", "Built to last for years."),
    ),
    _Category(
        "electronics",
        "Electronics › Accessories",
        ("headphones", "speaker", "charger", "keyboard", "mouse"),
        (
            "wireless",
            "bluetooth",
            "noise cancelling",
            "fast charging",
            "long battery life",
            "water resistant",
        ),
        {"color": ("black", "white", "blue", "silver"), "style": ("standard", "pro", "mini")},
        (15.0, 150.0),
        ("Works with phones, tablets and computers.", "Ready to use out of the box."),
    ),
)
# Brand names hold no option value (an option named in the title counts as matched).
BRANDS = [
    "Acme",
    "Northwind",
    "Kestrel",
    "Summit",
    "Harbor",
    "Cedar",
    "Aurora",
    "Sterling",
    "Willow",
    "Orion",
    "Zephyr",
    "Nimbus",
]
PRODUCTS_PER_TYPE = 12
# Product ids are "B<block>-<number>": two words each, so 15 + 20 words name 300 products.
ID_BLOCKS = tuple(f"b{k:02d}" for k in range(15))
ID_NUMBERS = tuple(f"{k:02d}" for k in range(20))
_REVIEW_TEXTS = (
    (5.0, "Exactly as described, would buy again."),
    (4.0, "Good value for the price."),
    (3.0, "It is fine, nothing special."),
    (2.0, "Not what I expected."),
)
_OPENERS = ("i am looking for", "i need", "i want", "find me")


def _article(phrase: str) -> str:
    return "an" if phrase[0] in "aeiou" else "a"


def _make_product(rng: random.Random, asin: str, cat: _Category, kind: str, brand: str) -> Product:
    attributes = tuple(rng.sample(cat.attributes, 3))
    options = {}
    for option, values in cat.options.items():
        kept = set(rng.sample(values, rng.randint(2, len(values))))
        options[option] = tuple(v for v in values if v in kept)
    low, high = cat.prices
    price = round(rng.uniform(low, high)) - 0.01
    if rng.random() < 0.25:  # a price range, sold at a price drawn inside it
        top = round(price * rng.uniform(1.1, 1.5), 2)
        pricing = (price, top)
        price_tag = f"${pricing[0]:.2f} to ${pricing[1]:.2f}"
        price = round(rng.uniform(*pricing), 2)
    else:
        price_tag = f"${price:.2f}"
    name = f"{brand} {attributes[0].title()} {kind.title()} - {attributes[1].title()}"
    bullets = (*tuple(f"{a.capitalize()}." for a in attributes), f"Sold by {brand}.")
    description = f"{kind.capitalize()} by {brand}. {' '.join(cat.blurbs)}"
    reviews = tuple(rng.sample(_REVIEW_TEXTS, rng.randint(0, 2)))
    return Product(
        asin=asin,
        name=name,
        query=kind,
        category=cat.name,
        product_category=f"{cat.path} › {kind.title()}",
        attributes=attributes,
        bullets=bullets,
        description=description,
        options=options,
        price_tag=price_tag,
        price=price,
        reviews=reviews,
    )


@lru_cache(maxsize=4)
def generated_shop(seed: int) -> Shop:
    """The catalog of `seed`: 12 products of each of 25 product types."""
    rng = random.Random(f"webshop-catalog-{seed}")
    ids = [f"{b}-{n}".upper() for b in ID_BLOCKS for n in ID_NUMBERS]
    rng.shuffle(ids)
    products = []
    for cat in CATEGORIES:
        for kind in cat.types:
            for brand in rng.sample(BRANDS, PRODUCTS_PER_TYPE):
                products.append(_make_product(rng, ids[len(products)], cat, kind, brand))
    rng.shuffle(products)
    return Shop(products=products, goals=None, source=f"generated (seed {seed})")


def generated_goal(shop: Shop, task_seed: int) -> tuple[Goal, str]:
    """A goal for task `task_seed` and the expert's search query (its attributes and
    product type), chosen so that the product is among the query's results."""
    rng = random.Random(f"webshop-task-{task_seed}")
    while True:
        product = rng.choice(shop.products)
        attributes = tuple(rng.sample(product.attributes, rng.randint(1, 3)))
        query = " ".join([*attributes, product.query])
        if product in shop.search(query):
            break
    chosen = {name: rng.choice(values) for name, values in product.options.items()}
    options = tuple(chosen.values())
    price_upper = price_bound(product.price, rng)
    wanted = " and ".join(
        [", ".join(attributes[:-1]), attributes[-1]] if len(attributes) > 1 else attributes
    )
    with_options = " and ".join(f"{value} {name}" for name, value in chosen.items())
    instruction = (
        f"{rng.choice(_OPENERS)} {_article(wanted)} {wanted} {product.query}"
        f" with {with_options}{price_text(price_upper)}"
    )
    goal = Goal(
        asin=product.asin,
        instruction=instruction,
        name=product.name,
        query=product.query,
        product_category=product.product_category,
        attributes=attributes,
        options=options,
        price_upper=price_upper,
    )
    return goal, query


def generated_words() -> list[str]:
    """Every word a command can hold on a generated catalog (queries, ids, options)."""
    phrases = [*ID_BLOCKS, *ID_NUMBERS]
    for cat in CATEGORIES:
        phrases += [*cat.types, *cat.attributes, *(v for vs in cat.options.values() for v in vs)]
    return sorted({w for phrase in phrases for w in words(phrase)})


# -- WebShop's own files ---------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise GagpoError(f"WebShop file {str(path)!r} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GagpoError(f"WebShop file {str(path)!r} cannot be read: {exc}") from None


def _first_file(folder: Path, names: tuple[str, ...], required: bool) -> Path | None:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    if required:
        raise GagpoError(
            f"WebShop data folder {str(folder)!r} has no {' or '.join(names)}; accepted: "
            "a folder holding WebShop's data files (see docs/environments.md)"
        )
    return None


def _bad(path: Path, what: str) -> GagpoError:
    return GagpoError(f"WebShop file {str(path)!r}: {what}")


def _field(path: Path, where: str, record: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(record, dict):
        raise _bad(path, f"{where} is not a JSON object")
    if key not in record:
        raise _bad(path, f"{where} has no '{key}'")
    value = record[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _bad(path, f"{where}: '{key}' must be {names}, got {type(value).__name__}")
    return value


def _pricing(path: Path, where: str, text: Any) -> tuple[tuple[float, ...], str]:
    """WebShop's "$12.99" / "$10.00 - $20.00" pricing: the prices and the shown tag."""
    if not text:
        return (100.0,), "$100.0"
    if not isinstance(text, str):
        raise _bad(path, f"{where}: 'pricing' must be a string such as \"$12.99\"")
    try:
        prices = tuple(float(re.sub(r"[^\d.]", "", part)) for part in text.split("$")[1:])
    except ValueError:
        raise _bad(path, f"{where}: 'pricing' {text!r} is not a price such as \"$12.99\"") from None
    if not prices:
        raise _bad(path, f"{where}: 'pricing' {text!r} is not a price such as \"$12.99\"")
    if len(prices) == 1:
        return prices, f"${prices[0]}"
    return prices[:2], f"${prices[0]} to ${prices[1]}"


def _product(path: Path, i: int, raw: Any, attributes: dict, reviews: dict) -> Product | None:
    where = f"product {i}"
    asin = _field(path, where, raw, "asin", str)
    if asin == "nan" or len(asin) > 10:  # skipped by WebShop too
        return None
    where = f"product {i} ({asin})"
    name = _field(path, where, raw, "name", str)
    bullets = raw.get("small_description") or []
    bullets = tuple(bullets) if isinstance(bullets, list) else (str(bullets),)
    options: dict[str, tuple[str, ...]] = {}
    for option, contents in (raw.get("customization_options") or {}).items():
        if contents is None:
            continue
        if not isinstance(contents, list):
            raise _bad(path, f"{where}: customization option {option!r} must be a list")
        options[option.lower()] = tuple(
            _field(path, f"{where} option {option!r}", c, "value", str)
            .strip()
            .replace("/", " | ")
            .lower()
            for c in contents
        )
    listed = attributes.get(asin, {}).get("attributes")  # checked by load_shop
    prices, price_tag = _pricing(path, where, raw.get("pricing"))
    price_rng = random.Random(f"webshop-price-{asin}")
    price = prices[0] if len(prices) == 1 else price_rng.uniform(*prices)
    return Product(
        asin=asin.upper(),
        name=name,
        query=str(raw.get("query", "")).lower().strip(),
        category=str(raw.get("category", "")),
        product_category=str(raw.get("product_category", "")),
        attributes=tuple(str(a) for a in listed) if listed else ("DUMMY_ATTR",),
        bullets=bullets,
        description=str(raw.get("full_description") or ""),
        options=options,
        price_tag=price_tag,
        price=price,
        reviews=reviews.get(asin, ()),
    )


def _reviews(path: Path | None) -> dict[str, tuple[tuple[float, str], ...]]:
    if path is None:
        return {}
    data = _read_json(path)
    if not isinstance(data, list):
        raise _bad(path, "expected a list of {asin, reviews} objects")
    out = {}
    for i, entry in enumerate(data):
        asin = _field(path, f"entry {i}", entry, "asin", str)
        items = _field(path, f"entry {i} ({asin})", entry, "reviews", list)
        try:
            out[asin] = tuple(
                (
                    float(r.get("score", r.get("stars", 0)) or 0),
                    str(r.get("body", r.get("review", ""))),
                )
                for r in items
                if isinstance(r, dict)
            )
        except (TypeError, ValueError):
            raise _bad(path, f"entry {i} ({asin}): a review score is not a number") from None
    return out


def _human_goals(path: Path, products: dict[str, Product]) -> list[Goal]:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise _bad(path, "expected an object mapping each asin to a list of instructions")
    goals = []
    for asin, entries in data.items():
        product = products.get(asin.upper())
        if product is None:
            continue
        if not isinstance(entries, list):
            raise _bad(path, f"instructions of {asin} must be a list")
        for k, entry in enumerate(entries):
            where = f"instruction {k} of {asin}"
            text = _field(path, where, entry, "instruction", str)
            attributes = _field(path, where, entry, "instruction_attributes", list)
            options = entry.get("instruction_options") or []
            if not attributes:  # skipped by WebShop too
                continue
            rng = random.Random(f"webshop-goal-{asin}-{k}")
            price_upper = price_bound(product.price, rng)
            goals.append(
                Goal(
                    asin=product.asin,
                    instruction=text.strip(".") + price_text(price_upper),
                    name=product.name,
                    query=product.query,
                    product_category=product.product_category,
                    attributes=tuple(str(a) for a in attributes),
                    options=tuple(str(o) for o in options),
                    price_upper=price_upper,
                )
            )
    if not goals:
        raise _bad(path, "no instruction with attributes for any product of the catalog")
    return goals


@lru_cache(maxsize=4)
def load_shop(data_dir: str) -> Shop:
    """WebShop's products and human instructions from `data_dir` (read once per process)."""
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise GagpoError(
            f"WebShop data_dir {data_dir!r} is not a folder; accepted: a folder holding "
            f"{PRODUCT_FILES[0]} and {HUMAN_GOALS_FILE}"
        )
    products_path = _first_file(folder, PRODUCT_FILES, required=True)
    goals_path = _first_file(folder, (HUMAN_GOALS_FILE,), required=True)
    attributes_path = _first_file(folder, ATTRIBUTE_FILES, required=False)
    attributes = _read_json(attributes_path) if attributes_path else {}
    if not isinstance(attributes, dict):
        raise _bad(attributes_path, "expected an object mapping each asin to its attributes")
    for asin, entry in attributes.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("attributes", []), list):
            raise _bad(attributes_path, f"{asin}: expected an object with an 'attributes' list")
    reviews = _reviews(_first_file(folder, (REVIEWS_FILE,), required=False))
    raw = _read_json(products_path)
    if not isinstance(raw, list):
        raise _bad(products_path, "expected a list of products")
    products: dict[str, Product] = {}
    for i, entry in enumerate(raw):
        product = _product(products_path, i, entry, attributes, reviews)
        if product is not None and product.asin not in products:
            products[product.asin] = product
    if not products:
        raise _bad(products_path, "holds no product")
    goals = _human_goals(goals_path, products)
    return Shop(products=list(products.values()), goals=goals, source=str(folder))
