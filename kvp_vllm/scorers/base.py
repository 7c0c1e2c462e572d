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

#: `Scorer.query_window` of a rule that reads the queries of every cached token (Expected Attention):
#: the server and the harness capture them all (the last W with W >= the cache length).
ALL_QUERIES = 1 << 30


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass
class Rope:
    """The model's rotary position embedding, in the form Llama/Qwen2/Mistral apply it (transformers'
    `apply_rotary_pos_emb` with `rotate_half`, vLLM's neox style): a query or key at position p is
    rotated pairwise (i, i + d/2) by angle p * inv_freq[i] and scaled by `attention_scaling`
    (transformers multiplies cos and sin by it; 1.0 but for YaRN-like types).

    inv_freq: [head_dim / 2] fp32 inverse frequencies (after any static scaling: linear, llama3, yarn).
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.inv_freq.dim() != 1 or not self.inv_freq.numel():
            raise ValueError(f"inv_freq must be [head_dim / 2]; got {tuple(self.inv_freq.shape)}")

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [P, head_dim] at the given positions, as transformers' rotary embedding
        computes them (`freqs = position * inv_freq`, `emb = cat(freqs, freqs)`, times the scaling)."""
        inv = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., P, head_dim] pre-RoPE -> post-RoPE (fp32)."""
        cos, sin = self.cos_sin(positions)
        x = x.float()
        return x * cos + _rotate_half(x) * sin

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., P, head_dim] post-RoPE -> pre-RoPE (fp32): the inverse of `rotate` (each pair is
        rotated by an orthogonal 2x2 matrix times the scaling)."""
        cos, sin = self.cos_sin(positions)
        x = x.float()
        return (x * cos - _rotate_half(x) * sin) / self.attention_scaling ** 2

    def mean_rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotation matrix R(p) = diag(cos_p) + diag(sin_p) P (P: rotate_half as a matrix), so that
        R(p) @ q = rotate(q, p), averaged over the given positions: [head_dim, head_dim] fp32."""
        cos, sin = self.cos_sin(positions)
        d = self.head_dim
        eye = torch.eye(d, dtype=torch.float32, device=cos.device)
        p = torch.zeros(d, d, dtype=torch.float32, device=cos.device)
        p[d // 2:, :d // 2] = torch.eye(d // 2, device=cos.device)
        p[:d // 2, d // 2:] = -torch.eye(d // 2, device=cos.device)
        return (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * p).mean(dim=0)  # as kvpress builds it


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
    rope:         the model's rotary embedding (`Rope`), for rules that undo or anticipate RoPE
                  (Expected Attention); filled by the harness, the server and the trainer's evaluation.
    reconstruction: [kv_heads, T] KVzip's importance: the maximum attention each token receives while
                  the model reconstructs the context (evaluation only, from a second forward pass).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: Optional[torch.Tensor] = None
    future_importance: Optional[torch.Tensor] = None
    layer: int = 0
    rope: Optional[Rope] = None
    reconstruction: Optional[torch.Tensor] = None

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
        if self.rope is not None and self.rope.head_dim != self.keys.shape[-1]:
            raise ValueError(f"the rotary embedding rotates {self.rope.head_dim} dimensions, the keys have "
                             f"{self.keys.shape[-1]} (partial rotary embeddings are not supported)")

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
                    queries: Optional[torch.Tensor] = None, rope: Optional[Rope] = None) -> torch.Tensor:
        """Scores [kv_heads, T] when each head holds its own tokens (positions [kv_heads, T]): by
        default head by head, each with its GQA group of queries. A rule that scores heads apart
        anyway (KVP) overrides it with one call."""
        h_kv = keys.shape[0]
        g = None if queries is None else queries.shape[0] // h_kv
        out = []
        for h in range(h_kv):
            qh = None if queries is None else queries[h * g:(h + 1) * g]
            out.append(self.score(LayerKV(keys[h:h + 1], values[h:h + 1], positions[h].contiguous(), qh,
                                          layer=layer, rope=rope)))
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
               heads_differ: bool = False, rope: Optional[Rope] = None) -> torch.Tensor:
    """Scores [kv_heads, T] of the tokens a (possibly already compacted) cache holds, as the server
    scores them at a compaction. keys/values [H, T, d]; positions [H, T] logical positions each head
    holds; queries [q_heads, W, d] or None. When `heads_differ` (an earlier compaction kept a different
    set per head) each head is scored on its own, with its own positions and GQA group of queries;
    otherwise (and always for a rule that keeps one set for every head) all heads at once. `rope`: the
    model's rotary embedding (Expected Attention needs it).
    Shared by the server (worker) and the harness's long-generation replay."""
    if not heads_differ or scorer.one_set_for_all_heads:  # every head holds the same tokens
        return scorer.score(LayerKV(keys, values, positions[0].contiguous(), queries, layer=layer, rope=rope))
    return scorer.score_heads(layer, keys, values, positions, queries, rope=rope)


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
