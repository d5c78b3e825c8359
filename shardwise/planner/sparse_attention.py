"""DeepSeek Sparse Attention in the planner: what `models/sparse_attention.py` and
`context_parallel/sparse_attention.py` move under context parallelism (the FLOPs are `rules.flops`')."""
from __future__ import annotations


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
