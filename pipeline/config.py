"""Typed configuration of the advantage stage: one model per estimator, a discriminated union.

Defaults the paper does not publish (γ, λ, normalisation) are ours and configurable:
γ = 0.95, λ = 0.8, group normalisation with the population std, no episode term.
Adding an estimator = one config variant here + one function registered in
`gagpo.pipeline.advantages`.
"""

from __future__ import annotations

import json
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator
from pydantic import ValidationError as PydanticValidationError

from gagpo.schemas.errors import GagpoError

Norm = Literal["group", "batch", "none", "mean"]
NORMS: tuple[str, ...] = typing.get_args(Norm)
GigpoVariant = Literal["paper", "verl_agent"]
GIGPO_VARIANTS: tuple[str, ...] = typing.get_args(GigpoVariant)
_EPS_DEFAULT = 1e-6
# Parameters left out of the `advantages/` folder name at these values (tags stay stable).
_UNTAGGED_DEFAULTS = {"eps": _EPS_DEFAULT, "variant": "paper"}
EXACT = "exact"  # the default state grouping: left out of parameters and tags


class _Estimator(BaseModel):
    """Fields every estimator has. Unknown keys are errors; docstrings document fields."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, strict=True
    )  # strict: `gamma = "0.9"` in a TOML table is refused, not read as 0.9

    gamma: float = Field(0.95, ge=0.0, le=1.0)
    """Discount γ of the return-to-go G_t = Σ_k γ^(k-t) r_k (and of the TD residual)."""
    norm: Norm = "group"
    """Normalisation of the raw advantage: group (z-score over all steps of the group),
    batch (z-score over the whole batch), mean (subtract the group mean only), none."""
    eps: float = Field(_EPS_DEFAULT, gt=0.0, le=1.0)
    """ε added to the population std in every z-score."""
    state_grouping: str = EXACT
    """Which steps of a group share a value-proxy pool (gagpo.pipeline.grouping): exact
    (equal state_key), normalized (case, digit runs and whitespace folded) or
    normalized:MODULE:FUNCTION, similar:TAU (verl-agent's difflib first-fit), minhash:TAU
    (order-independent MinHash/Jaccard components); 0 < TAU <= 1."""

    @field_validator("state_grouping", mode="before")
    @classmethod
    def _canonical_grouping(cls, value: Any) -> str:
        from gagpo.pipeline.grouping import parse_grouping  # Polars only when validating

        try:
            return parse_grouping(value).spec
        except GagpoError as exc:
            raise ValueError(str(exc)) from None

    def params(self) -> dict[str, Any]:
        """The parameters without the estimator name (stored as JSON in file metadata);
        the state grouping only when it is not exact, so exact files stay as they were."""
        exclude = {"estimator"} | ({"state_grouping"} if self.state_grouping == EXACT else set())
        return self.model_dump(exclude=exclude)

    def params_json(self) -> str:
        return json.dumps(self.params(), sort_keys=True)

    @property
    def tag(self) -> str:
        """Folder name under `advantages/` in the store: estimator and its parameters,
        e.g. `gagpo-gamma_0.95-norm_group-omega_episode_0.0-lam_0.8`; eps, GiGPO's
        variant and the state grouping are left out unless they differ from their
        defaults (`…-state_grouping_minhash_0.8`)."""
        parts = [self.estimator]  # type: ignore[attr-defined]
        for name, value in self.params().items():
            if name in _UNTAGGED_DEFAULTS and value == _UNTAGGED_DEFAULTS[name]:
                continue
            text = str(value).lower() if isinstance(value, bool) else str(value)
            if name == "state_grouping":  # similar:0.9 → similar_0.9 in a folder name
                text = text.replace(":", "_")
            parts.append(f"{name}_{text}")
        return "-".join(parts)


class _GagpoFamily(_Estimator):
    """Fields of GAGPO and its λ ablations."""

    omega_episode: float = Field(0.0, ge=0.0, le=100.0)
    """ω_E: weight of the GRPO episode advantage added to the normalised step advantage
    (0 = no episode term, the GAGPO default; >0 for the paper's ablation)."""


class GagpoConfig(_GagpoFamily):
    """GAGPO: GAE with γ, λ over TD residuals of the grouped value proxy (docs/design.md §4)."""

    estimator: Literal["gagpo"] = "gagpo"
    """Which estimator: the name picks the variant, and with it the parameters accepted
    beside it (GAGPO by default)."""
    lam: float = Field(0.8, ge=0.0, le=1.0)
    """GAE λ: 1 gives G_t − V̂(s_t) (plus the bootstrap of a truncated end), 0 one-step TD."""


class GagpoLambda0Config(_GagpoFamily):
    """Ablation: GAGPO with λ = 0 (the advantage is the one-step TD residual)."""

    estimator: Literal["gagpo_lambda0"] = "gagpo_lambda0"
    """Which estimator: GAGPO with λ = 0."""

    @property
    def lam(self) -> float:
        return 0.0

    def params(self) -> dict[str, Any]:
        return {**super().params(), "lam": self.lam}


class GagpoLambda1Config(_GagpoFamily):
    """Ablation: GAGPO with λ = 1 (return minus the grouped value proxy)."""

    estimator: Literal["gagpo_lambda1"] = "gagpo_lambda1"
    """Which estimator: GAGPO with λ = 1."""

    @property
    def lam(self) -> float:
        return 1.0

    def params(self) -> dict[str, Any]:
        return {**super().params(), "lam": self.lam}


class GigpoConfig(_Estimator):
    """GiGPO: episode advantage + ω · step advantage, the step advantage being G_t minus
    the mean return of its anchor-state pool (singleton pools give 0). `norm` applies to
    the episode term."""

    estimator: Literal["gigpo"] = "gigpo"
    """Which estimator: GiGPO."""
    omega: float = Field(1.0, ge=0.0, le=100.0)
    """ω: weight of the step advantage."""
    step_std: bool = True
    """Divide the step advantage by the pool's std (+ε); false = mean-only."""
    variant: GigpoVariant = "paper"
    """paper: population std, episode term normalised over the group's rollouts (one value
    each), as docs/design.md §4. verl_agent: as verl-agent's core_gigpo.py computes it:
    Bessel-corrected std (ddof = 1) in both terms, and the episode term's mean and std
    taken over step rows, so a rollout weighs by its length (a scope of one row: mean 0,
    std 1)."""


class GrpoConfig(_Estimator):
    """GRPO: the episode return (undiscounted sum of rewards) normalised over the group's
    rollouts, broadcast to every step. γ only shapes the `return` and proxy columns."""

    estimator: Literal["grpo"] = "grpo"
    """Which estimator: GRPO."""


class RlooConfig(_Estimator):
    """RLOO: episode return minus the mean return of the group's other rollouts,
    broadcast to every step (0 when the group has one rollout). Unnormalised by default."""

    estimator: Literal["rloo"] = "rloo"
    """Which estimator: RLOO."""
    norm: Norm = "none"
    """Normalisation of the leave-one-out advantage over the group's rollouts (default none)."""


EstimatorConfig = Annotated[
    GagpoConfig | GagpoLambda0Config | GagpoLambda1Config | GigpoConfig | GrpoConfig | RlooConfig,
    Field(discriminator="estimator"),
]
# Each variant's `estimator` literal, in the union's order.
ESTIMATOR_NAMES: tuple[str, ...] = tuple(
    variant.model_fields["estimator"].default
    for variant in typing.get_args(typing.get_args(EstimatorConfig)[0])
)
_ADAPTER: TypeAdapter[EstimatorConfig] = TypeAdapter(EstimatorConfig)


def parse_estimator_config(data: dict[str, Any]) -> EstimatorConfig:
    """Validate a mapping (TOML table or CLI flags, `estimator` defaults to gagpo) into its
    config variant; a bad value becomes one GagpoError line naming the field."""
    data = {"estimator": "gagpo", **{k: v for k, v in data.items() if v is not None}}
    name = data["estimator"]
    if name not in ESTIMATOR_NAMES:
        raise GagpoError(f"unknown estimator {name!r}; accepted: {', '.join(ESTIMATOR_NAMES)}")
    try:
        return _ADAPTER.validate_python(data)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"][1:]) or "estimator"
        if first["type"] == "extra_forbidden":
            raise GagpoError(
                f"estimator {name} has no parameter {field!r}; accepted: {', '.join(_fields(name))}"
            ) from None
        raise GagpoError(
            f"estimator parameter {field!r}: {first['msg']} (got {first.get('input')!r})"
        ) from None


def _fields(name: str) -> list[str]:
    variant = {
        "gagpo": GagpoConfig,
        "gagpo_lambda0": GagpoLambda0Config,
        "gagpo_lambda1": GagpoLambda1Config,
        "gigpo": GigpoConfig,
        "grpo": GrpoConfig,
        "rloo": RlooConfig,
    }[name]
    return [f for f in variant.model_fields if f != "estimator"]


class AdvantagesCommand(BaseModel):
    """`gagpo advantages`: what to read and where to write. Every other key of its TOML
    table ([advantages], or the top level) is a field of the estimator config."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    input: list[str] = Field(default_factory=list)
    """Parquet files or globs of steps, with at least group_id, traj_id, step, state_key,
    next_state_key, reward, done and truncated; each file is one batch."""
    out: str | None = None
    """Where to write the advantages table (with input)."""
    store: str | None = None
    """Store root: recompute for its committed shards."""
    run: str | None = None
    """With store: only the shards of this run."""
    as_of_update: int | None = Field(None, ge=0)
    """With store: only the groups its learner had consumed by this update (the store as it
    stood then), written under the tag <estimator_tag>@u<update>."""
    compression: str = "snappy"
    """Parquet codec of out: snappy, zstd, lz4 or none."""

    @field_validator("input", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    def estimator_settings(self) -> dict[str, Any]:
        """The table's estimator fields (validated by `parse_estimator_config`)."""
        return dict(self.model_extra or {})
