"""The one scoring interface shared by the trainer, the evaluation harness and the server.

A scoring rule looks at one layer's cache for one sequence and returns a score per KV head and
cached token; higher means "more worth keeping". `kvp_vllm.selection.select_topb` then turns the
scores into the kept indices. Every rule lives in its own file in this package and registers itself
with `@register("name")`.

Definitions are versioned: a rule's `version` is bumped whenever its default scores change, and its
docstring says what each version was. Evaluation rows record `Scorer.definition` ("v2", or "v2" plus
the options that differ from the defaults), so a result folder never averages two definitions of a
rule. Rows written before versioning carry no definition: they are `LEGACY_DEFINITION` ("v1").
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, ClassVar, Dict, Optional, Tuple, Type

import torch


@dataclass
class LayerKV:
    """One layer's cache for one sequence, as the server sees it.

    keys, values: [kv_heads, T, head_dim], keys post-RoPE (as cached).
    positions:    [T] int64 logical token positions (0..T-1 before any eviction).
    queries:      [q_heads, W, head_dim] the queries (post-RoPE) of the last W cached tokens, in order;
                  only the query-aware rules (TOVA, SnapKV) need them. q_heads is a multiple of kv_heads
                  (GQA: query head h belongs to KV head h // (q_heads // kv_heads)).
    future_importance: [kv_heads, T] the true future attention mass c_i (oracle only).
    layer:        the layer index (the learned policy has one scorer per layer and head).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: Optional[torch.Tensor] = None
    future_importance: Optional[torch.Tensor] = None
    layer: int = 0

    def __post_init__(self) -> None:
        if self.keys.dim() != 3 or self.values.shape != self.keys.shape:
            raise ValueError(
                f"keys and values must both be [kv_heads, T, head_dim]; got {tuple(self.keys.shape)} "
                f"and {tuple(self.values.shape)}"
            )
        if self.positions.shape != (self.keys.shape[1],):
            raise ValueError(
                f"positions must be [T]={self.keys.shape[1]}; got {tuple(self.positions.shape)}"
            )
        if self.queries is not None:
            if self.queries.dim() != 3 or self.queries.shape[-1] != self.keys.shape[-1]:
                raise ValueError(
                    f"queries must be [q_heads, W, head_dim={self.keys.shape[-1]}]; "
                    f"got {tuple(self.queries.shape)}"
                )
            if self.queries.shape[0] % self.keys.shape[0]:
                raise ValueError(
                    f"{self.queries.shape[0]} query heads is not a multiple of "
                    f"{self.keys.shape[0]} KV heads"
                )

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]

    def grouped_queries(self) -> torch.Tensor:
        """Queries as [kv_heads, group, W, head_dim] so each KV head sees its own GQA group."""
        if self.queries is None:
            raise ValueError("this scoring rule needs the last queries; LayerKV.queries is None")
        q_heads, w, d = self.queries.shape
        return self.queries.reshape(self.num_kv_heads, q_heads // self.num_kv_heads, w, d)


#: The definition of every rule before definitions were versioned (rows without `rule_def`).
LEGACY_DEFINITION = "v1"


class Scorer:
    """Base class of a scoring rule. Subclasses are dataclasses with typed, documented defaults."""

    name: ClassVar[str] = ""
    #: Version of the rule's default definition; bump it when the default scores change.
    version: ClassVar[int] = 1
    #: Dataclass fields that are inputs rather than options of the definition (a seed, the weights).
    not_definition_options: ClassVar[Tuple[str, ...]] = ()
    #: True when the rule needs `LayerKV.queries` (the server must capture them).
    needs_queries: ClassVar[bool] = False
    #: True for rules that look at the future (the oracle): evaluation only, never served.
    evaluation_only: ClassVar[bool] = False

    def score(self, kv: LayerKV) -> torch.Tensor:  # pragma: no cover - interface
        """Return float32 scores [kv_heads, T]; higher = keep."""
        raise NotImplementedError

    @property
    def one_set_for_all_heads(self) -> bool:
        """True when the rule gives every KV head the same scores (so every head keeps the same
        tokens): the server then scores all heads of a compacted request together, with every
        query head, instead of head by head."""
        return False

    @property
    def query_window(self) -> int:
        """How many of the last queries the rule reads (0 = none): what the server captures."""
        return 0

    @classmethod
    def default_definition(cls) -> str:
        """The definition of the rule with its default options: "v<version>"."""
        return f"v{cls.version}"

    @property
    def definition(self) -> str:
        """"v<version>", followed by every option that differs from its default (",name=value")."""
        opts = []
        for f in fields(self) if hasattr(self, "__dataclass_fields__") else ():
            if f.name in self.not_definition_options or not f.init:
                continue
            value = getattr(self, f.name)
            if value != f.default:
                opts.append(f"{f.name}={value!r}")
        return ",".join([self.default_definition(), *opts])

    def score_heads(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    queries: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scores [kv_heads, T] when each head holds its own tokens (positions [kv_heads, T]): by
        default head by head, each with its GQA group of queries. A rule that scores heads apart
        anyway (KVP) overrides it with one call."""
        h_kv = keys.shape[0]
        g = None if queries is None else queries.shape[0] // h_kv
        out = []
        for h in range(h_kv):
            qh = None if queries is None else queries[h * g:(h + 1) * g]
            out.append(self.score(LayerKV(keys[h:h + 1], values[h:h + 1], positions[h].contiguous(), qh,
                                          layer=layer)))
        return torch.cat(out, dim=0)

    def select_paged(self, layer: int, kv_cache: torch.Tensor, layout: str, block_tables: torch.Tensor,
                     seq_lens, budgets, positions: torch.Tensor, position_lengths, n_sink: int,
                     n_recent: int):
        """Optional fused path for the server: score + select a batch of requests of one layer
        straight from vLLM's paged cache (see ``kvp_vllm.kernels.paged_score_select`` for the
        arguments) and return a ``kvp_vllm.kernels.Selection``. None (the default) means the rule has
        no such path: the server gathers each request's keys/values and calls :meth:`score`."""
        return None


def score_held(scorer: Scorer, layer: int, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, queries: Optional[torch.Tensor] = None,
               heads_differ: bool = False) -> torch.Tensor:
    """Scores [kv_heads, T] of the tokens a (possibly already compacted) cache holds, as the server
    scores them at a compaction. keys/values [H, T, d]; positions [H, T] logical positions each head
    holds; queries [q_heads, W, d] or None. When `heads_differ` (an earlier compaction kept a different
    set per head) each head is scored on its own, with its own positions and GQA group of queries;
    otherwise (and always for a rule that keeps one set for every head) all heads at once.
    Shared by the server (worker) and the harness's long-generation replay."""
    if not heads_differ or scorer.one_set_for_all_heads:  # every head holds the same tokens
        return scorer.score(LayerKV(keys, values, positions[0].contiguous(), queries, layer=layer))
    return scorer.score_heads(layer, keys, values, positions, queries)


SCORERS: Dict[str, Type[Scorer]] = {}


def register(name: str) -> Callable[[Type[Scorer]], Type[Scorer]]:
    def wrap(cls: Type[Scorer]) -> Type[Scorer]:
        if name in SCORERS:
            raise ValueError(f"scoring rule {name!r} registered twice")
        cls.name = name
        SCORERS[name] = cls
        return cls

    return wrap


def make_scorer(name: str, **kwargs) -> Scorer:
    """Build a scoring rule by its registered name, with a clear error for an unknown one."""
    if name not in SCORERS:
        raise ValueError(f"unknown eviction rule {name!r}; known rules: {', '.join(sorted(SCORERS))}")
    return SCORERS[name](**kwargs)


def attention_probs(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                    key_positions: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention in fp32.

    queries [kv_heads, group, W, d], keys [kv_heads, T, d] -> probs [kv_heads, group, W, T].
    A query at position p sees keys at positions <= p (the query's own token included).
    """
    d = keys.shape[-1]
    logits = torch.einsum("hgwd,htd->hgwt", queries.float(), keys.float()) / d ** 0.5
    visible = key_positions[None, :] <= query_positions[:, None]  # [W, T]
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1)
