"""Routing policies: a registry of lazy factories; adding one is a file plus one line here."""
from __future__ import annotations

import importlib

from services.router.policies.base import BY_LOAD, BY_MATCH, Candidate, Choice, Policy

# name → "module:class"; the class takes (config, seed=None).
POLICIES = {
    "cache_aware": "services.router.policies.cache_aware:CacheAware",
    "round_robin": "services.router.policies.round_robin:RoundRobin",
    "random": "services.router.policies.random_choice:Random",
    "power_of_two": "services.router.policies.power_of_two:PowerOfTwo",
    "least_load": "services.router.policies.least_load:LeastLoad",
}


def make_policy(name: str, config=None, seed: int | None = None) -> Policy:
    """Build the named policy; ValueError names the known ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    module, cls = POLICIES[name].split(":")
    return getattr(importlib.import_module(module), cls)(config, seed=seed)


__all__ = ["BY_LOAD", "BY_MATCH", "POLICIES", "Candidate", "Choice", "Policy", "make_policy"]
