"""WebShop (Yao et al., NeurIPS 2022): find and buy the product an instruction describes.

The agent sees WebShop's text pages ("[SEP]"-joined, as its `text` observation mode)
and acts with its grammar: `search[keywords]` on the search page, `click[text]` on
anything clickable: a product id on a results page, "next >" and "< prev", an option
value, "description", "features", "reviews", "back to search", "buy now". Buying ends
the episode with WebShop's reward (webshop_reward.py); other turns earn 0, and a reply
that is not a command of the current page costs the project's invalid-action penalty
and changes nothing. Navigation follows WebShop's server: a search resets the chosen
options; "< prev" goes from an item to its results page and from a sub-page to its item.

A rollout is won when it buys with reward 1, the success rate of the WebShop paper.
The state key is the page and what shapes it (query, page number, product, chosen
options), never the history, so a group's rollouts meet the same states.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from gagpo.envs.base import INVALID_ACTION_PENALTY, Reset, Transition
from gagpo.envs.webshop_data import (
    PRODUCT_WINDOW,
    Goal,
    Product,
    Shop,
    generated_goal,
    generated_shop,
    generated_words,
    load_shop,
    words,
)
from gagpo.envs.webshop_reward import reward
from gagpo.schemas.errors import GagpoError

SEP = " [SEP] "
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW = "back to search", "next >", "< prev", "buy now"
SUB_PAGES = ("description", "features", "reviews")
SEARCH_ACTION = "search[<your query>]"  # how the search page lists its one action
GRAMMAR_WORDS = ("search", "click", "your", "query", "back", "to", "next", "prev", "buy", "now")
_COMMAND = re.compile(
    r"\b(search|click)\s*\[\s*([^\]\n]*?)\s*(?:\]|$)", re.IGNORECASE | re.MULTILINE
)


def canonical(text: str) -> str:
    """Lower-case words and punctuation marks, single-spaced: "B03-17" -> "b03 - 17"."""
    return " ".join(re.findall(r"\w+|[^\w\s]", text.lower()))


def parse_command(reply: str) -> tuple[str, str] | None:
    """("search" | "click", argument) of the first command in a reply, or None."""
    match = _COMMAND.search(reply)
    return (match.group(1).lower(), match.group(2)) if match else None


@dataclass
class Page:
    """Where the agent is: everything the next page and the state key depend on."""

    kind: str = "search"  # search, results, item, description, features, reviews
    query: str = ""
    number: int = 1
    results: list[Product] = field(default_factory=list)
    product: Product | None = None
    options: dict[str, str] = field(default_factory=dict)  # option name -> chosen value

    def key(self) -> str:
        if self.kind == "search":
            return "search"
        key = f"{self.kind} query='{self.query}' page={self.number}"
        if self.product is not None:
            chosen = ",".join(f"{k}:{v}" for k, v in sorted(self.options.items()))
            key += f" item={self.product.asin} options={chosen}"
        return key


class WebShop:
    """Buy the product an instruction asks for, on a generated catalog or WebShop's own."""

    name = "webshop"

    def __init__(
        self, max_turns: int = 15, *, data_dir: str | None = None, catalog_seed: int = 0
    ) -> None:
        """`data_dir`: a folder with WebShop's data files (products, human instructions);
        without it, a catalog and instructions generated from `catalog_seed`."""
        if max_turns < 1:
            raise GagpoError(f"max_turns must be at least 1, got {max_turns}")
        if not isinstance(catalog_seed, int) or catalog_seed < 0:
            raise GagpoError(f"catalog_seed must be an integer >= 0, got {catalog_seed!r}")
        self.max_turns = max_turns
        self.data_dir = data_dir
        self.shop: Shop = load_shop(str(data_dir)) if data_dir else generated_shop(catalog_seed)
        self.goal: Goal | None = None
        self._plan: list[str] | None = None
        self._page = Page()
        self._turn = 0
        self._over = True

    # -- episode ----------------------------------------------------------------------

    def reset(self, task_seed: int) -> Reset:
        if self.shop.goals is None:
            self.goal, query = generated_goal(self.shop, task_seed)
            self._plan = self._plan_for(query)
        else:
            self.goal = self.shop.goals[task_seed % len(self.shop.goals)]
            self._plan = None  # built on demand: it costs a search
        self._page = Page()
        self._turn = 0
        self._over = False
        return Reset(self._observation(), self._page.key(), self._admissible())

    def step(self, reply: str) -> Transition:
        if self._over or self.goal is None:
            raise RuntimeError("the WebShop episode is over (or never began); call reset() first")
        before = self._page.key()
        self._turn += 1
        command = parse_command(reply)
        outcome = self._apply(*command) if command else None
        done = won = False
        if outcome is None:
            reward_value, valid = INVALID_ACTION_PENALTY, False
            observation = "Invalid action." + SEP + self._observation()
        elif outcome == "bought":
            product = self._page.product
            assert product is not None
            result = reward(product, self.goal, product.price, self._page.options)
            reward_value, valid, done = result.total, True, True
            won = math.isclose(result.total, 1.0)
            observation = (
                f"Thank you for shopping with us!{SEP}Your score (min 0.0, max 1.0){SEP}"
                f"{result.total:.2f}"
            )
        else:
            reward_value, valid = 0.0, True
            observation = self._observation()
        truncated = not done and self._turn >= self.max_turns
        self._over = done or truncated
        return Transition(
            observation=observation,
            state_key=before,
            next_state_key=None if done else self._page.key(),
            reward=reward_value,
            done=done,
            truncated=truncated,
            action_valid=valid,
            admissible=() if done else self._admissible(),
            won=won,
        )

    def _apply(self, verb: str, argument: str) -> str | None:
        """Carry out a command: "moved", "bought", or None when it is not valid here."""
        page = self._page
        if verb == "search":
            query = " ".join(words(argument))
            if page.kind != "search" or not query:
                return None
            self._page = Page("results", query, 1, self.shop.search(query))
            return "moved"
        target = self._clickables().get(canonical(argument))
        if target is None:
            return None
        kind, value = target
        if kind == "back":
            self._page = Page()
        elif kind == "page":
            self._page = Page("results", page.query, value, page.results)
        elif kind == "product":
            self._page = Page("item", page.query, page.number, page.results, value)
        elif kind == "option":
            page.options[value[0]] = value[1]
        elif kind == "sub":
            page.kind = value
        elif kind == "item":  # "< prev" from a sub-page
            page.kind = "item"
        elif kind == "buy":
            return "bought"
        return "moved"

    def _clickables(self) -> dict[str, tuple[str, object]]:
        """Canonical clickable text -> (what it does, its argument), for the current page."""
        page = self._page
        if page.kind == "search":
            return {}
        out: dict[str, tuple[str, object]] = {canonical(BACK_TO_SEARCH): ("back", None)}
        if page.kind == "results":
            if page.number > 1:
                out[canonical(PREV_PAGE)] = ("page", page.number - 1)
            if page.number * PRODUCT_WINDOW < len(page.results):
                out[canonical(NEXT_PAGE)] = ("page", page.number + 1)
            for product in self._on_page():
                out[canonical(product.asin)] = ("product", product)
        elif page.kind == "item":
            assert page.product is not None
            out[canonical(PREV_PAGE)] = ("page", page.number)
            for option, values in page.product.options.items():
                for value in values:
                    out[canonical(value)] = ("option", (option, value))
            for sub in SUB_PAGES:
                out[sub] = ("sub", sub)
            out[canonical(BUY_NOW)] = ("buy", None)
        else:
            out[canonical(PREV_PAGE)] = ("item", None)
        return out

    def _admissible(self) -> tuple[str, ...]:
        page = self._page
        if page.kind == "search":
            return (SEARCH_ACTION,)
        texts = [BACK_TO_SEARCH]
        if page.kind == "results":
            texts += [PREV_PAGE] if page.number > 1 else []
            texts += [NEXT_PAGE] if page.number * PRODUCT_WINDOW < len(page.results) else []
            texts += [p.asin.lower() for p in self._on_page()]
        elif page.kind == "item":
            assert page.product is not None
            texts += [PREV_PAGE, *(v for vs in page.product.options.values() for v in vs)]
            texts += [*SUB_PAGES, BUY_NOW]
        else:
            texts += [PREV_PAGE]
        return tuple(f"click[{t}]" for t in texts)

    def _on_page(self) -> list[Product]:
        page = self._page
        return page.results[(page.number - 1) * PRODUCT_WINDOW : page.number * PRODUCT_WINDOW]

    # -- pages as text ----------------------------------------------------------------

    def _observation(self) -> str:
        assert self.goal is not None
        page = self._page
        head = ["Instruction:", self.goal.instruction]
        if page.kind == "search":
            return SEP.join(["WebShop", *head, "Search"])
        parts = [*head, "Back to Search"]
        if page.kind == "results":
            parts.append(f"Page {page.number} (Total results: {len(page.results)})")
            parts += ["< Prev"] if page.number > 1 else []
            parts += ["Next >"] if page.number * PRODUCT_WINDOW < len(page.results) else []
            for product in self._on_page():
                parts += [product.asin, product.name, product.price_tag]
            return SEP.join(parts)
        product = page.product
        assert product is not None
        parts.append("< Prev")
        if page.kind == "item":
            for option, values in product.options.items():
                parts += [option, *values]
            parts += [product.name, f"Price: {product.price_tag}", f"Rating: {product.rating}"]
            parts += ["Description", "Features", "Reviews", "Buy Now"]
            clicked = "".join(f"You have clicked {v}.\n" for v in page.options.values())
            return clicked + SEP.join(parts)
        if page.kind == "description":
            parts.append(product.description or "(no description)")
        elif page.kind == "features":
            parts += list(product.bullets) or ["(no features)"]
        else:
            parts += [f"{score:.0f} stars: {text}" for score, text in product.reviews] or [
                "(no reviews)"
            ]
        return SEP.join(parts)

    # -- protocol ---------------------------------------------------------------------

    @property
    def instructions(self) -> str:
        return (
            "You are shopping on WebShop for the product an instruction describes. On the "
            "search page reply search[keywords]; elsewhere click[text] on anything clickable: "
            "a product id in the results, next > or < prev, an option value on a product "
            "page, description, features, reviews, back to search, or buy now. Buying ends "
            "the episode with a score from 0 to 1 for how well the product, its options and "
            "its price match the instruction; a reply that is not a command of the page costs "
            "0.1. Reply with exactly one command."
        )

    def expert_plan(self) -> list[str] | None:
        """Commands that buy the goal's product with the goal's options from the start:
        search for the instruction's attributes and product type (generated tasks) or the
        product's name (WebShop's files), page to it, click it, choose, buy."""
        if self.goal is None:
            return None
        if self._plan is None:
            self._plan = self._plan_for(self.shop.by_asin[self.goal.asin].name)
        return list(self._plan) if self._plan is not None else None

    def _plan_for(self, query: str) -> list[str] | None:
        assert self.goal is not None
        query = " ".join(words(query))
        target = self.shop.by_asin[self.goal.asin]
        results = self.shop.search(query)
        if target not in results:
            return None
        on_results = self._to_target(results, 1, target)
        return [f"search[{query}]", *on_results, *self._choose_and_buy(target, {})]

    def _to_target(self, results: list[Product], number: int, target: Product) -> list[str]:
        """From results page `number`, page to `target` and click it."""
        wanted = results.index(target) // PRODUCT_WINDOW + 1
        moves = [f"click[{NEXT_PAGE}]"] * (wanted - number)
        moves += [f"click[{PREV_PAGE}]"] * (number - wanted)
        return [*moves, f"click[{target.asin.lower()}]"]

    def _choose_and_buy(self, target: Product, chosen: dict[str, str]) -> list[str]:
        """On the target's page: click each goal option not chosen yet, then buy."""
        assert self.goal is not None
        wanted = set(self.goal.options)
        plan = []
        for option, values in target.options.items():
            value = next((v for v in values if v in wanted), None)
            if value is not None and chosen.get(option) != value:
                plan.append(f"click[{value}]")
        return [*plan, f"click[{BUY_NOW}]"]

    def replan(self) -> list[str] | None:
        """The expert's commands from the current page (after a detour): back to the
        target's page by the shortest way the pages offer, then choose and buy."""
        plan = self.expert_plan()
        if plan is None or self.goal is None:
            return None
        page = self._page
        target = self.shop.by_asin[self.goal.asin]
        prefix = [f"click[{PREV_PAGE}]"] if page.kind in SUB_PAGES else []
        if page.kind != "search" and page.product is target:
            return [*prefix, *self._choose_and_buy(target, page.options)]
        if page.product is not None:
            prefix.append(f"click[{PREV_PAGE}]")  # a sub-page or item: up to the results
        if page.kind != "search" and target in page.results:
            to_target = self._to_target(page.results, page.number, target)
            return [*prefix, *to_target, *self._choose_and_buy(target, {})]
        return plan if page.kind == "search" else [f"click[{BACK_TO_SEARCH}]", *plan]

    @classmethod
    def vocabulary(cls) -> list[str]:
        """Words of every command on a generated catalog (ids, queries, options, buttons)."""
        return sorted({*GRAMMAR_WORDS, *SUB_PAGES, *generated_words()})
