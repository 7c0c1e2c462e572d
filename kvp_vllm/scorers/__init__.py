"""Scoring rules, one file each, registered by name in `SCORERS`."""

from .base import SCORERS, LayerKV, Scorer, attention_probs, make_scorer, register
from . import kvp, streaming, tova, snapkv, lagkv, keydiff, knorm, random, oracle  # noqa: F401  (register)

#: Rules a server may run (the oracle needs the future).
SERVABLE_RULES = tuple(sorted(n for n, c in SCORERS.items() if not c.evaluation_only))
#: Rules that need the last queries captured.
QUERY_AWARE_RULES = tuple(sorted(n for n, c in SCORERS.items() if c.needs_queries))

__all__ = ["SCORERS", "LayerKV", "Scorer", "attention_probs", "make_scorer", "register",
           "SERVABLE_RULES", "QUERY_AWARE_RULES"]
