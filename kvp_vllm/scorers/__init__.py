"""Scoring rules, one file each, registered by name in `SCORERS`."""

from .base import (ALL_QUERIES, LEGACY_DEFINITION, SCORERS, LayerKV, Rope, Scorer, attention_probs,
                   make_scorer, register, score_held)
from . import (kvp, streaming, tova, snapkv, lagkv, keydiff, knorm, random, oracle,  # noqa: F401  (register)
               expected_attention, kvzip)

#: Rules a server may run (the oracle needs the future, KVzip a second forward pass).
SERVABLE_RULES = tuple(sorted(n for n, c in SCORERS.items() if not c.evaluation_only))
#: Rules that need the last queries captured.
QUERY_AWARE_RULES = tuple(sorted(n for n, c in SCORERS.items() if c.needs_queries))
#: The training-free rules KVP is compared with (every servable rule but KVP itself).
BASELINE_RULES = tuple(n for n in SERVABLE_RULES if n != "kvp")


def rule_definition(name: str) -> str:
    """The current default definition of a registered rule ("v<version>"; see base.py)."""
    if name not in SCORERS:
        raise ValueError(f"unknown eviction rule {name!r}; known rules: {', '.join(sorted(SCORERS))}")
    return SCORERS[name].default_definition()


__all__ = ["SCORERS", "LayerKV", "Rope", "ALL_QUERIES", "Scorer", "attention_probs", "make_scorer", "register",
           "score_held", "SERVABLE_RULES", "QUERY_AWARE_RULES", "BASELINE_RULES", "LEGACY_DEFINITION",
           "rule_definition"]
