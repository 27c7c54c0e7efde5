"""Policy backends: one interface (`PolicyBackend`), a transformers implementation, presets.

Heavy libraries (torch, transformers) are imported only when a policy is loaded.
"""

from gagpo.actors.policies.base import PolicyBackend, Sample, SamplingConfig
from gagpo.actors.policies.presets import load_policy, resolve_model

__all__ = ["PolicyBackend", "Sample", "SamplingConfig", "load_policy", "resolve_model"]
