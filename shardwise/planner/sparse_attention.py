"""DeepSeek Sparse Attention in the planner: what `models/sparse_attention.py` and
`context_parallel/sparse_attention.py` move under context parallelism (the FLOPs are `rules.flops`')."""
from __future__ import annotations

from shardwise.rules import inventory


def cp_comm(led, spec, lay, wl, layers: int, again: int) -> None:
    """Per microbatch, each DSA layer under cp (either --cp-impl): forward one all-gather of this rank's MLA latents
    [b, s/cp, kv_lora_rank + qk_rope_dim] and one of its indexer keys [b, s/cp, index_head_dim] (activation dtype;
    replaced by nothing else: no ring, no all-to-all), backward the reduce-scatter of the latents' gradient (the
    ledger books a reduce-scatter's whole input: cp times the shard; the indexer keys carry no gradient). Full
    recompute repeats the `again` recomputed layers' two all-gathers; selective replays only the core after them."""
    c = lay.cp
    if c < 2 or not layers:
        return
    tokens = lay.mb * (wl.seq_len // c) * wl.act_bytes
    latent = tokens * (spec.kv_lora_rank + spec.qk_rope_dim)
    led.add("cp", "all_gather:dsa", latent, c, layers + again)
    led.add("cp", "all_gather:dsa", tokens * spec.index_head_dim, c, layers + again)
    led.add("cp", "reduce_scatter:dsa", c * latent, c, layers)


def attention_bytes(spec, mb: int, s_loc: int, seq_len: int, hq: int, e: int, recompute: str) -> int:
    """What a DSA layer's attention saves past its region input and latent norms (`SparseMLA.forward` as the
    runtime runs it; measured by tests/test_sparse_attention.py): wq_b's output (q_nope and q_rope are views of it),
    the sparse core's inputs and outputs — the latents of all `seq_len` keys (gather keeps its source; under cp the
    gathered sequence, plus the int64 permutation into sequence order), the k selected latents of each query, the
    int64 indices and the bool mask, the per-head query [W_ukᵀq_nope | q_rope], the fp32 softmax, the latent output
    — and wo's input. The indexer runs without gradient: it saves nothing. Selective recompute, or a core cut into
    several query chunks (`inventory.dsa_query_rows`), keeps the core's inputs instead (q_lat, the rotated q_rope, the
    latents, indices, mask). Under bf16 the softmax's bf16 copy comes on top (the einsums' bf16 copies of W_uk and
    W_uv are wkv_b's cast, which `layer_cast_terms` counts as for MLA)."""
    n, k = mb * s_loc, min(spec.index_topk, seq_len)
    r, rope, qk = spec.kv_lora_rank, spec.qk_rope_dim, spec.head_dim + spec.qk_rope_dim
    out = e * n * hq * qk + e * mb * seq_len * (r + rope) + 8 * n * k + n * k + e * n * hq * (r + spec.v_head_dim)
    out += 8 * seq_len if seq_len > s_loc else 0  # cp: index_select's permutation into sequence order
    if recompute == "selective" or inventory.dsa_query_rows(mb, k, r + rope, hq) < s_loc:
        return out + e * n * hq * (r + rope)
    out += e * n * k * (r + rope) + e * n * hq * (r + rope) + 4 * n * hq * k
    return out + (e * n * hq * k if e != 4 else 0)
