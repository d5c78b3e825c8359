"""Context parallelism: every rank holds s/cp tokens of each sequence; attention sees them all.

* `sharding`: which tokens a rank owns (load-balanced chunk order by default) and their positions;
* `ring_attention`: K/V blocks passed around the cp ring over p2p, LSE-merged (any head counts);
* `ulysses`: all-to-all from sequence shards to head shards and back around full-sequence SDPA.
"""
from ..rules.partition import ORDERS, check_seq_len, chunk_ids, num_chunks
from .ring_attention import block_plan, ring_attention
from .sharding import layout_positions, positions, shard_sequence, unshard_sequence
from .ulysses import ulysses_attention

__all__ = ["ORDERS", "block_plan", "check_seq_len", "chunk_ids", "layout_positions", "num_chunks", "positions",
           "ring_attention", "shard_sequence", "ulysses_attention", "unshard_sequence"]
