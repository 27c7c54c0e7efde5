"""The trained model: base policy resolution and loading, action log-probs, LoRA adapters (peft).

Models are loaded from local folders as safetensors only (`use_safetensors=True`,
`local_files_only=True`): nothing is fetched and nothing is unpickled.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from gagpo.learner.batching import MicroBatch
from gagpo.schemas.cache import policy_cache_dir
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.policy import PolicySpec
from gagpo.storage.store import Store

WAIT_NOTE_S = 60.0  # the wait for the base policy says it still waits this often


def resolve_policy(
    spec: str, store: Store, *, poll_s: float = 2.0, wait_s: float | None = None, echo=None
) -> Path:
    """The base policy (version 0) as a local folder.

    A Hugging Face folder is used as it is. A preset name (tiny, smollm2-135m) or hub id is
    materialised by the actors, which publish it as STORE/policy/v0 before their first
    rollout; the learner waits for that folder, so both sides start from the same weights
    and the learner never imports the actors. It waits `wait_s` seconds at most (None:
    as long as it takes); an unknown preset name or a missing folder fails at once
    (`PolicySpec.parse`).
    """
    policy = PolicySpec.parse(spec)
    if policy.kind == "folder":
        path = Path(policy.value)
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise GagpoError(
                f"policy folder {spec!r} is not a Hugging Face model folder; accepted: a folder with "
                "config.json and safetensors weights, or a preset name (tiny, smollm2-135m)"
            )
        return path
    waiting = f"base policy {spec!r} as {store.policies.dir(0)}"
    if not store.policies.has(0) and echo is not None:
        echo(f"waiting for the actors to publish {waiting}")
    start = time.monotonic()
    deadline = None if wait_s is None else start + wait_s
    said = start
    while not store.policies.has(0):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise GagpoError(
                f"no base policy: {store.policies.dir(0)} did not appear within {wait_s:g}s; "
                f"accepted: gagpo-actors --policy {spec} writing to this store (they publish "
                "it), or --policy FOLDER with a Hugging Face model folder"
            )
        if echo is not None and now - said >= WAIT_NOTE_S:  # a wait with no end says so
            said = now
            bound = f"{wait_s:g} s at most" if wait_s is not None else "no bound (--idle-timeout)"
            echo(
                f"still waiting for the actors to publish {waiting}: {now - start:.0f} s so far, "
                f"{bound}; gagpo-actors --policy {spec} on this store publishes it"
            )
        time.sleep(poll_s)
    return Path(store.policies.fetch(0, str(policy_cache_dir())))


def load_model(folder: Path, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True, use_safetensors=True
    )
    return model.to(device)


def has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def action_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
    vocab_chunks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_k | context, y_<k) of every action token [A, L], and the entropy if asked.

    Each action sits at its own positions of its row (a segment, or a group's prefix trie:
    learner/batching.py), so only the hidden states that predict an action token are
    projected onto the vocabulary: a pre-hook on the output embedding gathers them
    (`mb.token_rows`, `mb.token_cols`) before the projection. The hook sits on the module
    itself, so it holds inside FSDP2's root forward, with peft's in-place adapters and
    under autocast alike; transformers' `logits_to_keep` keeps the same columns for every
    row, which segments do not share.

    With `vocab_chunks` (the default) the hook also scores them, walking the vocabulary in
    chunks and recomputing them in the backward (learner/vocab_chunks.py), and hands the
    head an empty input: no [N, V] tensor is ever held. Off, or for a head that is not a
    plain linear layer, the head projects the N states and the softmax runs over [N, V].
    With `autocast_dtype` (bf16, see `precision.py`) the forward pass runs under autocast;
    the softmax is always taken in float32."""
    from gagpo.learner.precision import autocast
    from gagpo.learner.vocab_chunks import chunkable, chunked_logprobs

    rows, cols = mb.token_rows, mb.token_cols
    targets = mb.targets()  # [N] the token each position predicts
    head = model.get_output_embeddings()
    chunked = vocab_chunks and chunkable(head, model.config)
    scored: list[tuple[torch.Tensor, torch.Tensor]] = []

    def action_positions(module, args):
        hidden = args[0][rows, cols]  # [b, T, H] → [N, H]
        if not chunked:
            return (hidden, *args[1:])
        scored.append(chunked_logprobs(module, hidden, targets, temperature, autocast_dtype))
        return (hidden[:0], *args[1:])  # the head projects nothing

    hook = head.register_forward_pre_hook(action_positions)
    try:
        with autocast(mb.input_ids.device, autocast_dtype):
            out = model(
                input_ids=mb.input_ids,
                attention_mask=mb.model_attention_mask(),
                position_ids=mb.position_ids,
                logits_to_keep=0,  # every position reaches the head; the hook keeps N
                use_cache=False,
            )
    finally:
        hook.remove()
    if chunked:
        logp, entropy = scored[0]
        return _per_action(logp, mb), _per_action(entropy, mb) if with_entropy else None
    logits = out.logits.float() / temperature  # [N, V]
    log_norm = torch.logsumexp(logits, dim=-1)  # [N]
    logp = _per_action(logits.gather(-1, targets[:, None]).squeeze(-1) - log_norm, mb)
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = _per_action(log_norm - (probs * logits).sum(-1), mb)  # H = logZ − E[logit]
    return logp, entropy


def _per_action(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[N] values of the tokens read → [A, L] on `mb.action_mask` (0 elsewhere)."""
    return values.new_zeros(mb.action_mask.shape).masked_scatter(mb.action_mask, values)


# --- LoRA (through peft) ----------------------------------------------------------------
#
# Adapters are injected into the plain transformers model in place (peft's
# `inject_adapter_in_model`), so the rest of the learner (optimiser, checkpoints, FSDP
# checks, `action_logprobs`) sees the same module it always does, with the base frozen and
# only the adapter parameters trainable. Publication writes a standard PEFT folder
# (`adapter_config.json` + `adapter_model.safetensors`) that transformers+peft and vLLM
# load as it is, or merged full weights.

ADAPTER = "default"  # peft's adapter name; one adapter per model


def lora_config(rank: int, alpha: float, targets: list[str], dropout: float = 0.0, base: str = ""):
    """The peft `LoraConfig` of the learner's adapters (also written as adapter_config.json)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=sorted(targets),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
    )


def add_lora(
    model: nn.Module, rank: int, alpha: float, targets: list[str], dropout: float = 0.0
) -> list[str]:
    """Freeze the model and give every linear layer whose name ends in a target a LoRA
    adapter (y = W x + (alpha/r) · B A x, B = 0 at the start); return the adapted names
    (an error when none matches)."""
    from gagpo.schemas.extras import require

    require("lora", "lora.enabled")
    from peft import inject_adapter_in_model

    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] in targets
    ]
    if not names:
        raise GagpoError(
            f"lora.target_modules {targets} match no linear layer of the model; accepted: "
            "names such as q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(lora_config(rank, alpha, targets, dropout), model, ADAPTER)
    for name, p in model.named_parameters():  # peft trains the adapters only; say so explicitly
        p.requires_grad_("lora_" in name)
    return names


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: peft LoRA layer} of every adapted linear layer."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under the names a PEFT folder uses
    (base_model.model.<module>.lora_A.weight, ...), as `PeftModel.save_pretrained` writes them."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {f"base_model.model.{k}": v.detach().contiguous() for k, v in state.items()}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter merged into its base weight:
    W' = W + (alpha/r) · B A, under the original parameter names."""
    wrapped = lora_modules(model)
    state = {}
    for name, tensor in model.state_dict().items():
        owner = next((n for n in wrapped if name.startswith(n + ".")), None)
        if owner is None:
            state[name] = tensor
            continue
        rest = name[len(owner) + 1 :]
        if rest == "base_layer.weight":
            delta = wrapped[owner].get_delta_weight(ADAPTER)
            state[f"{owner}.weight"] = (tensor + delta.to(tensor.dtype)).detach()
        elif rest.startswith("base_layer."):
            state[f"{owner}.{rest[len('base_layer.') :]}"] = tensor
    return state
