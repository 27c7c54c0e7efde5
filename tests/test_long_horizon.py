"""Long-horizon agents, the actor's side (issue 38): the tokens a policy sampled are the
tokens the next prompt holds, and context limits are met the way agents expect.

- A prompt that holds the previous chat and the reply unchanged is the previous prompt +
  action ids + the template's closing and new turns: exactly the template's own ids where
  the round trip is lossless (tiny, smollm2-135m's template), the sampled ids kept where it
  is not. An agent that keeps its history (`openai` agent, verifiers multi-turn) and a
  native environment with a full-history window record 0 breaks; an agent that edits its
  history has its breaks counted in the actor's summary.
- An agent's call past the context gets OpenAI's 400 `context_length_exceeded` from the
  `openai` client and records no step; the agent that stops there is truncated.
- A native prompt past the budget drops whole oldest turns, never its system prompt or
  current turn (where the task is restated); a turn that alone does not fit ends the
  rollout truncated.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest

from gagpo.actors.actor import run_actor
from gagpo.actors.policies.base import SamplingConfig
from gagpo.actors.policies.presets import load_policy
from gagpo.actors.policies.prompt_ids import Prior, encode_prompt, text_ids
from gagpo.actors.prompts import fit_messages
from gagpo.actors.rollout import rollout_group
from gagpo.schemas import columns as C
from gagpo.schemas import extends
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.validate import validate_steps
from tests.helpers import long_horizon
from tests.helpers.actors import actor_config
from tests.helpers.history import full_history_steps
from tests.helpers.steps import steps_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CORRIDOR = "agent:tests.helpers.long_horizon:corridor"


def extends_previous(steps: pl.DataFrame) -> pl.Series:
    """Per step after a rollout's first: does its prompt begin with the previous step's
    prompt + action ids (computed here from the columns, not by the actor)."""
    return (
        steps.sort(C.TRAJ_ID, C.STEP)
        .with_columns(
            pl.concat_list(C.PROMPT_IDS, C.ACTION_IDS).shift(1).over(C.TRAJ_ID).alias("p")
        )
        .filter(pl.col("p").is_not_null())
        .select(pl.col(C.PROMPT_IDS).list.head(pl.col("p").list.len()) == pl.col("p"))
        .to_series()
    )


# -- the bridge, on two templates ------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def chat_policy(request):
    """A stand-in policy holding only a tokenizer (tiny's, or smollm2-135m's from its GGUF)."""
    from transformers import AutoTokenizer

    from gagpo.actors.policies.folders import load_chat_tokenizer
    from gagpo.actors.policies.presets import smollm2_gguf, tiny_dir

    if request.param == "tiny":
        return SimpleNamespace(tokenizer=load_chat_tokenizer(tiny_dir()))
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return SimpleNamespace(tokenizer=tokenizer)


CHAT = [
    {"role": "system", "content": "you are in a corridor ."},
    {"role": "user", "content": "go left or right ."},
]
REPLY = {"role": "assistant", "content": "go left"}
LATER = [*CHAT, REPLY, {"role": "user", "content": "you see a door ."}]


def prior_of(policy, action: list[int], reply: dict = REPLY) -> Prior:
    first = encode_prompt(policy, CHAT)
    return Prior(tuple(CHAT), None, first.text or "", tuple(first.ids), tuple(action), reply)


def test_a_kept_reply_extends_the_prompt_as_the_template_would(chat_policy):
    tokenizer = chat_policy.tokenizer
    fresh = encode_prompt(chat_policy, LATER)
    assert not fresh.extends
    words = text_ids(tokenizer, "go left")
    for action in ([*words, tokenizer.eos_token_id], words):  # ended by eos, or cut
        extended = encode_prompt(chat_policy, LATER, None, prior_of(chat_policy, action))
        assert extended.extends and extended.ids == fresh.ids
        assert extended.text == fresh.text


def test_sampled_ids_that_do_not_survive_decoding_are_kept(chat_policy):
    tokenizer = chat_policy.tokenizer
    odd = tokenizer.convert_tokens_to_ids("<|im_start|>")  # decoded away: "go left" again
    action = [*text_ids(tokenizer, "go"), odd, *text_ids(tokenizer, " left")]
    assert tokenizer.decode(action, skip_special_tokens=True).split() == ["go", "left"]
    prior = prior_of(chat_policy, [*action, tokenizer.eos_token_id])
    extended = encode_prompt(chat_policy, LATER, None, prior)
    head = [*prior.prompt, *prior.action]
    assert extended.extends and extended.ids[: len(head)] == head
    fresh = encode_prompt(chat_policy, LATER).ids
    assert fresh[: len(head)] != head  # what decoding and encoding again would have recorded
    assert extended.ids[len(head) :] == fresh[len(fresh) - len(extended.ids) + len(head) :]


def test_an_edited_history_or_changed_tools_is_rendered_afresh(chat_policy):
    tokenizer = chat_policy.tokenizer
    prior = prior_of(chat_policy, [*text_ids(tokenizer, "go left"), tokenizer.eos_token_id])
    edited = [*CHAT, {"role": "assistant", "content": "go right"}, LATER[-1]]
    dropped = [CHAT[0], LATER[-1]]
    for messages in (edited, dropped):
        encoded = encode_prompt(chat_policy, messages, None, prior)
        assert not encoded.extends and encoded.ids == encode_prompt(chat_policy, messages).ids
    tools = ({"type": "function", "function": {"name": "move"}},)
    assert not encode_prompt(chat_policy, LATER, tools, prior).extends


# -- agents through the endpoint -------------------------------------------------------


def corridor_config(store: Path, **overrides):
    base = dict(
        group_size=2, groups=1, max_turns=24, sampling={"max_new_tokens": 3, "max_reply_tokens": 3}
    )
    return actor_config(store, CORRIDOR, **(base | overrides))


def test_an_agent_that_keeps_its_history_has_no_breaks(tmp_path: Path):
    summary = run_actor(corridor_config(tmp_path))
    steps = steps_of(tmp_path)
    assert steps.group_by(C.TRAJ_ID).len()["len"].max() >= 20  # a long horizon
    extends = extends_previous(steps)
    assert len(extends) >= 20 and extends.all()
    assert summary.prompt_drift == 0 and summary.window_slides == 0


def test_an_agent_that_edits_its_history_has_its_breaks_counted(tmp_path: Path):
    summary = run_actor(corridor_config(tmp_path, max_turns=12, env_options={"edit_every": 4}))
    breaks = int((~extends_previous(steps_of(tmp_path))).sum())
    assert summary.prompt_drift > 0 and summary.prompt_drift + summary.window_slides == breaks


def test_a_verifiers_multi_turn_environment_has_no_breaks(tmp_path: Path, monkeypatch):
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed")
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "helpers"))
    config = actor_config(
        tmp_path,
        "verifiers:verifiers_fixture",
        group_size=4,
        groups=2,
        sampling={"max_new_tokens": 4},
        env_options={"traces": str(tmp_path / "traces"), "turn_timeout_s": 30},
    )
    summary = run_actor(config)
    extends = extends_previous(steps_of(tmp_path))
    assert len(extends) > 0 and extends.all() and summary.prompt_drift == 0


@pytest.mark.parametrize("on_context", ["return", "raise"])
def test_a_call_past_the_context_is_openais_400_and_records_no_step(tmp_path: Path, on_context):
    long_horizon.CONTEXT_ERRORS.clear()
    budget = 200
    summary = run_actor(
        corridor_config(
            tmp_path,
            max_turns=40,
            sampling={"max_new_tokens": 3, "max_prompt_tokens": budget},
            env_options={"grow": 8, "on_context": on_context},
        )
    )
    assert summary.groups_lost == 0  # an agent that stops there is truncated, not lost
    errors = long_horizon.CONTEXT_ERRORS
    assert len(errors) == 2 and {e[:3] for e in errors} == {
        (400, "context_length_exceeded", "messages")
    }
    steps = steps_of(tmp_path)
    rollouts = (
        steps.sort(C.STEP)
        .group_by(C.TRAJ_ID)
        .agg(pl.len().alias("steps"), pl.col(C.TRUNCATED).last(), pl.col(C.DONE).last())
    )
    # One step per answered call: the refused call recorded none.
    assert sorted(rollouts["steps"]) == sorted(e[3] for e in errors)
    assert rollouts[C.TRUNCATED].all() and not rollouts[C.DONE].any()
    assert steps[C.PROMPT_IDS].list.len().max() <= budget  # nothing was cut to fit
    assert extends_previous(steps).all()


# -- native environments ---------------------------------------------------------------


def native(policy, *, grow: int, max_turns: int, window: int = 100):
    """One group of CorridorEnv played natively, its steps in (rollout, step) order."""
    result = rollout_group(
        lambda: long_horizon.CorridorEnv(max_turns=max_turns, grow=grow),
        policy,
        task_seed=3,
        group_id="g",
        run_id="r",
        shard_id="s",
        group_size=2,
        history_window=window,
        sampling_seed=0,
    )
    return pl.DataFrame(result.columns).sort(C.TRAJ_ID, C.STEP), result


def test_a_full_history_window_extends_every_prompt():
    policy = load_policy("tiny", sampling=SamplingConfig(max_new_tokens=3), device="cpu")
    steps, result = native(policy, grow=0, max_turns=20)
    extends = extends_previous(steps)
    assert len(extends) >= 20 and extends.all() and result.drift == result.slides == 0


def test_native_prompts_keep_their_system_prompt_and_task_and_drop_whole_turns():
    budget = 160
    policy = load_policy(
        "tiny", sampling=SamplingConfig(max_new_tokens=3, max_prompt_tokens=budget), device="cpu"
    )
    steps, result = native(policy, grow=6, max_turns=30)
    tokenizer = policy.tokenizer
    start, user = tokenizer.convert_tokens_to_ids(["<|im_start|>", "user"])
    system = text_ids(tokenizer, f"<|im_start|> system {long_horizon.SYSTEM} <|im_end|>")
    dropped = slides = 0
    for traj in steps.partition_by(C.TRAJ_ID, maintain_order=True):
        observations = [text_ids(tokenizer, o) for o in traj[C.OBSERVATION]]
        for t, prompt in enumerate(traj[C.PROMPT_IDS].to_list()):
            assert len(prompt) <= budget and prompt[: len(system)] == system
            # Every user message is a whole turn: it begins with an observation of the
            # rollout, the last with the current one (which restates the task).
            users = [i + 2 for i in range(len(prompt) - 1) if prompt[i : i + 2] == [start, user]]
            for i in users:
                assert any(prompt[i : i + len(o)] == o for o in observations[: t + 1])
            current = observations[t]
            assert prompt[users[-1] : users[-1] + len(current)] == current
            dropped += len(users) < t + 1
            if t:  # a slide keeps an earlier turn; one that keeps none cannot be told
                before = traj[C.PROMPT_IDS][t - 1].to_list(), traj[C.ACTION_IDS][t - 1].to_list()
                found = extends.kind(prompt, *before)
                assert found == "drift" if len(users) == 1 else found != "drift"
                slides += found == "slide"
        # The current turn grows until it alone does not fit: the rollout ends truncated.
        assert traj[C.TRUNCATED][-1] and not traj[C.DONE][-1] and len(traj) < 30
    # Whole oldest turns were dropped on the way: window slides, where an earlier turn is
    # kept; a prompt that keeps none holds nothing that says a window moved (drift).
    assert dropped > 0 and result.slides == slides > 0


def test_a_first_prompt_past_the_budget_is_one_line():
    policy = load_policy(
        "tiny", sampling=SamplingConfig(max_new_tokens=3, max_prompt_tokens=16), device="cpu"
    )
    with pytest.raises(RuntimeError, match=r"first prompt of corridor is \d+ tokens, past"):
        native(policy, grow=0, max_turns=5)


def test_fit_messages_drops_whole_oldest_turns_only():
    system, now = {"role": "system", "content": "s"}, {"role": "user", "content": "now"}
    turns = [
        {"role": role, "content": f"{role} {i}"} for i in range(5) for role in ("user", "assistant")
    ]
    messages = [system, *turns, now]
    size = lambda m: sum(len(x["content"]) for x in m)  # noqa: E731
    for budget in range(size([system, now]), size(messages) + 1):
        kept = fit_messages(messages, lambda m, b=budget: size(m) <= b)
        assert kept is not None and size(kept) <= budget
        assert (
            kept[0] == system
            and kept[-1] == now
            and kept[1:-1] == turns[len(turns) - len(kept) + 2 :]
        )
        assert len(kept) % 2 == 0  # whole (user, assistant) turns
        # the fewest dropped: one turn more would not have fit
        more = [system, *turns[len(turns) - len(kept) + 2 - 2 :], now]
        assert len(kept) == len(messages) or size(more) > budget
    assert fit_messages(messages, lambda m: size(m) < size([system, now])) is None


def test_full_history_steps_are_valid_and_each_extends_the_last():
    """The learner's full-history steps (tests/helpers/history.py, built without a model)
    are what the actor records for an agent that keeps its history."""
    table = full_history_steps(turns=30, groups=2, group_size=3)
    validate_steps(
        table,
        {C.META_SCHEMA_VERSION: C.STEPS_SCHEMA_VERSION.encode(), C.META_GROUP_SIZE: b"3"},
        vocab_size=100,
    )
    steps = pl.from_arrow(table)
    assert len(steps) == 2 * 3 * 30 and extends_previous(steps).all()


def test_an_actor_whose_first_prompts_do_not_fit_says_so_in_one_line(tmp_path: Path):
    lines = []
    with pytest.raises(GagpoError, match="lost"):
        run_actor(
            actor_config(
                tmp_path,
                "sokoban",
                groups=1,
                sampling={"max_new_tokens": 3, "max_prompt_tokens": 16},
            ),
            warn=lines.append,
        )
    assert len(lines) == 1 and "past the policy's prompt budget of 16" in lines[0]


def test_a_native_history_window_slides_and_never_drifts(tmp_path: Path, capsys):
    """Sokoban with `history_window = 2` (issue 47: it read `prompt breaks 40/56`): its
    prompts extend the previous turn until the window is full, then drop its oldest turn.
    The actor's closing line, the `prompt_drift` view and `gagpo view` say 0 drift, and
    count the slides."""
    from gagpo.actors.cli import _print_summary
    from gagpo.inspection import sql
    from gagpo.inspection.view.data import StoreSession, group_view
    from gagpo.storage.store import Store

    config = actor_config(
        tmp_path,
        "sokoban",
        group_size=2,
        groups=2,
        max_turns=8,
        history_window=2,
        sampling={"max_new_tokens": 3},
    )
    summary = run_actor(config)
    later = summary.steps - summary.rollouts
    assert summary.window_slides > 0 and summary.prompt_drift == 0
    _print_summary(summary, str(tmp_path))
    assert (
        f"prompt drift 0/{later} (window slides {summary.window_slides})" in capsys.readouterr().out
    )
    store = Store(str(tmp_path))
    (row,) = sql.query_store(
        store,
        "SELECT count(*) FILTER (WHERE drift) AS drift, "
        "count(*) FILTER (WHERE window_slide) AS slides FROM prompt_drift",
    ).to_pylist()
    assert row == {"drift": 0, "slides": summary.window_slides}
    session = StoreSession("native", str(tmp_path))
    try:
        groups = {r[C.GROUP_ID] for r in steps_of(tmp_path).to_dicts()}
        pages = [group_view(session, g, "grpo", {})["drift"] for g in groups]
    finally:
        session.close()
    assert sum(p["drift"] for p in pages) == 0
    assert sum(p["slides"] for p in pages) == summary.window_slides
