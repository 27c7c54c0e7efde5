"""What a policy version and a policy name mean, for every layer (docs/design.md §4, §6).

- `staleness`: how many versions the behaviour policy is behind the policy being updated;
- `is_hub_id`: whether a `--policy` value names a Hugging Face hub repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

V = TypeVar("V")  # an int, or an array/tensor of versions (numpy, torch, Polars)


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
