"""Split-backward schedules (zb, dualpipev): what the weight-gradient store (`pipeline.grad_store`) holds
between a microbatch's B and its W, beyond the activations of the microbatches in flight — a term of the
live peak (`planner.peak`)."""
from __future__ import annotations

from shardwise.planner.activations import microbatch_activation_bytes, region_input
from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners
from shardwise.planner.models import ModelSpec, local_kv_heads, padded_vocab
from shardwise.planner.rank_actions import split_states
from shardwise.planner.schedule import in_flight


def deferred_w_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """What a split-backward schedule's weight-gradient store keeps per microbatch through one rank's
    layers between its B and its W: every linear's input (kept past B, when autograd would free it) and
    its output gradient (activation dtype). Dense layers and the LM head; routed experts compute dW in B."""
    e, r, t, h = wl.act_bytes, wl.resid_bytes, lay.tp, spec.dim
    n = lay.mb * wl.seq_len // lay.cp
    hq, hkv, dk, dv = spec.n_heads // t, local_kv_heads(spec, t), spec.k_dim, spec.v_dim
    ffn = spec.ffn_dim // t
    mats = 3 if spec.mlp == "swiglu" else 2
    layer = (region_input(n, h, 3, e, r) + e * n * hq * dv + region_input(n, h, mats - 1, e, r) + e * n * ffn
             + e * n * (hq * dk + hkv * (dk + dv)) + 2 * e * n * h + (mats - 1) * e * n * ffn)
    head = region_input(n, h, 1, e, r) + e * n * (padded_vocab(spec, t) // t) if stage.head else 0
    return float(layer * stage.n_dense + head)


def weight_store_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """Split-backward schedules (zb, dualpipev): what the weight-gradient store holds at the worst moment,
    beyond the activations of the microbatches in flight (`deferred_w_bytes` per pending microbatch)."""
    if lay.pp == 1 or lay.schedule not in ("zb", "dualpipev"):
        return 0.0
    chunks = sum(1 for o in chunk_owners(lay) if o == stage.index)
    mb = microbatch_activation_bytes(spec, stage, lay, wl)
    act = (mb["total"] - mb["head"]) / chunks
    w = deferred_w_bytes(spec, stage, lay, wl) / chunks
    try:
        states = split_states(lay.schedule, lay.pp, lay.m, lay.vp, stage.index)
    except (ImportError, ValueError):
        return 0.0
    peak = max((act * held + w * pending for held, pending in states), default=0.0)
    return max(0.0, peak - act * chunks * in_flight(lay, stage.index))
