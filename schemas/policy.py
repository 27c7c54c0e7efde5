"""What a policy version and a policy name mean, for every layer (docs/design.md §4, §6).

- `staleness`: how many versions the behaviour policy is behind the policy being updated;
- `PolicySpec.parse`: what a `--policy` value names (a preset, a model folder, a hub id);
  `is_hub_id` is its test for the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from gagpo.schemas.errors import GagpoError

V = TypeVar("V")  # an int, or an array/tensor of versions (numpy, torch, Polars)

# Base policies built by the actors and published as policy/v0 (actors/policies/presets.py);
# here so the learner can name them without importing the actors.
POLICY_PRESETS = ("tiny", "smollm2-135m")


def staleness(learner_version: int, policy_version: V) -> V:
    """Versions between the behaviour policy and the policy being updated (design §6).

    `learner_version` is the version the learner holds when it forms the batch: the
    policy π_prox whose update publishes `learner_version + 1`. `policy_version` is the
    version that sampled the data (a group's oldest step). Data of the learner's own
    version has staleness 0; a group is trained iff its staleness ≤ `max_staleness`.
    After an update the learner holds `learner_version + 1`: figures computed then pass
    the version the batch was formed at, never the new one."""
    return learner_version - policy_version


def is_hub_id(spec: str) -> bool:
    """`org/name` (optionally `@revision`) that is not a path on this machine."""
    repo = spec.split("@", 1)[0]
    return (
        repo.count("/") == 1
        and not repo.startswith(("/", ".", "~"))
        and all(part and part.strip() == part for part in repo.split("/"))
        and not Path(repo).expanduser().exists()
    )


def missing_model_error(spec: str) -> GagpoError:
    """The one line for a model path that is not a folder."""
    return GagpoError(
        f"model path '{spec}' does not exist; accepted: {', '.join(POLICY_PRESETS)}, "
        "a folder holding a Hugging Face model, or a hub id (org/name) in the local cache"
    )


@dataclass(frozen=True)
class PolicySpec:
    """What a `--policy` value names, told apart once for the actors and the learner:

    - `preset`: a name of POLICY_PRESETS, built by the actors (it wins over a folder of
      that name, so both sides always mean the same weights);
    - `hub`: a Hugging Face hub id, `org/name[@revision]`, that is not a local path;
    - `folder`: a local folder (`~` expanded), expected to hold a Hugging Face model.
    """

    kind: Literal["preset", "hub", "folder"]
    value: str
    """preset: its name; hub: the id as given; folder: the path, `~` expanded."""

    @classmethod
    def parse(cls, text: str | Path) -> PolicySpec:
        """The spec `text` names; GagpoError (one line) for a name that is no preset nor
        folder, or a path that is not a folder."""
        text = str(text)
        if text in POLICY_PRESETS:
            return cls("preset", text)
        if is_hub_id(text):
            return cls("hub", text)
        path = Path(text).expanduser()
        if text.strip() and path.is_dir():
            return cls("folder", str(path))
        if "/" not in text and not text.startswith((".", "~")):  # a name, not a path
            raise GagpoError(
                f"policy {text!r} is neither a preset nor a folder; accepted: "
                f"{', '.join(POLICY_PRESETS)}, a Hugging Face model folder, or a hub id (org/name)"
            )
        raise missing_model_error(text)
