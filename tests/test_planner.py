"""The planner is pure arithmetic: every check here runs in-process, without torch.distributed."""
from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

from shardwise.config import MODEL_PRESETS, ModelConfig
from shardwise.planner import (
    Assumptions, Cluster, Layout, PlanError, Workload, bubble_fraction, estimate, get_gpu, get_model,
    layout_problems, load_hf_config, memory_by_stage, model_flops, parse_layout, search, step_comm, total_params,
    wire_bytes,
)
from shardwise.commands.plan import main
from shardwise.planner.layout import stages
from shardwise.planner.activations import layer_activation_bytes
from shardwise.planner.memory import stage_params
from shardwise.planner.models import ModelSpec, attention_tensors, layer_params
from shardwise.planner.search import SearchSpace

PLAN_DEFAULTS = dict(zero=1, recompute="selective", sequence_parallel=True)
"""The search's starting point (`shardwise plan`'s flags' defaults), on which these expectations were computed."""


def planned(**kw) -> Layout:
    return Layout(**(PLAN_DEFAULTS | kw))

H100 = get_gpu("h100-80gb")
DONE_WHEN = ["plan", "--model", "llama3-70b", "--gpus", "256", "--gpus-per-node", "8", "--gpu", "h100-80gb",
             "--seq-len", "4096", "--global-batch", "1024"]
CONTRACT_KEYS = {"layout", "params_total", "params_per_rank", "static_bytes_per_rank", "activation_bytes_per_rank",
                 "layers_per_stage", "bubble_fraction", "comm_bytes_per_step", "comm_wire_bytes_per_step",
                 "comm_ops_per_step", "model_flops_per_step", "hardware_flops_per_step", "step_time_s", "mfu", "fits"}


def rank0_ledger(spec, lay, wl):
    mem = memory_by_stage(spec, lay, wl)
    return step_comm(spec, mem[0]["stage"], lay, wl, mem[0]["params"])[2].as_dict()


def static_of(spec, lay, wl=Workload()):
    return max(memory_by_stage(spec, lay, wl), key=lambda s: s["total"])["static"]


def activation_of(spec, lay, wl=Workload()):
    return max(s["activation"] for s in memory_by_stage(spec, lay, wl))


# --- textbook sanity -------------------------------------------------------------------------------

def test_70b_static_memory_is_16_bytes_per_param():
    spec = get_model("llama3-70b")
    static = static_of(spec, planned(zero=0, sequence_parallel=False))
    assert static["total"] == 16 * total_params(spec)
    assert static["total"] == pytest.approx(1120e9, rel=0.01)


def test_tp8_pp4_on_256_gpus_leaves_dp8():
    lay = parse_layout("tp=8,pp=4", planned(), 256, 1024)
    assert (lay.dp, lay.tp, lay.pp, lay.m) == (8, 8, 4, 128)


@pytest.mark.parametrize("m,expected", [(8, 7 / 15), (64, 7 / 71)])
def test_1f1b_bubble(m, expected):
    assert bubble_fraction(planned(pp=8, m=m))[0] == pytest.approx(expected)
    assert bubble_fraction(planned(pp=8, m=m, schedule="gpipe"))[0] == pytest.approx(expected)


def test_interleaved_and_zero_bubble_bubbles():
    assert bubble_fraction(planned(pp=8, m=8, vp=2, schedule="interleaved"))[0] == pytest.approx(7 / 23)
    frac, source = bubble_fraction(planned(pp=8, m=8, schedule="zb"))
    assert source in ("simulator", "approximation") and 0 <= frac < 7 / 15


def test_zero_bubble_schedules_use_the_simulator_extrapolated():
    pytest.importorskip("shardwise.rules.schedule_check")
    from shardwise.rules.schedules import build_schedule
    from shardwise.rules.schedule_check import simulate

    for sched, v in (("zb", 1), ("dualpipev", 2)):
        frac, source = bubble_fraction(planned(pp=8, m=96, vp=v, schedule=sched))
        direct = simulate(build_schedule(sched, 8, 96, v)).bubble_fraction
        assert source == "simulator" and frac == pytest.approx(direct, rel=0.02)


def test_tp_all_reduce_wire_volume():
    s = h = 8192
    t = 8
    assert wire_bytes("all_reduce", s * h * 2, t) == 2 * (t - 1) / t * (s * h * 2)
    spec = replace(get_model("llama3-70b"), dim=h)
    ops = rank0_ledger(spec, planned(tp=t, mb=1, m=1, sequence_parallel=False), Workload(seq_len=s, global_batch=1))
    ar = ops["tp"]["all_reduce"]
    # bf16 activations: 1 embedding + per layer 2 forward (wo/w2 outputs) and 2 backward (grads of the norm
    # outputs) + 1 head backward, all bf16, + 2 small fp32 CE all-reduces.
    assert ar["count"] == 1 + 4 * 80 + 1 + 2
    assert ar["bytes"] == s * h * 2 + 4 * 80 * s * h * 2 + s * h * 2 + s * 4 + s * 8
    # --fp32-residual: the embedding, the entries' gradients and the head's stay fp32 (autocast casts after f)
    ops = rank0_ledger(spec, planned(tp=t, mb=1, m=1, sequence_parallel=False), Workload(seq_len=s, global_batch=1, fp32_residual=True))
    ar = ops["tp"]["all_reduce"]
    assert ar["bytes"] == s * h * 4 + 2 * 80 * s * h * 2 + 2 * 80 * s * h * 4 + s * h * 4 + s * 4 + s * 8


# --- parameters ----------------------------------------------------------------------------------

def test_param_counts():
    assert total_params(get_model("llama3-8b")) == pytest.approx(8.03e9, rel=1e-3)
    assert total_params(get_model("llama3-70b")) == pytest.approx(70.6e9, rel=1e-3)
    assert total_params(get_model("mixtral-8x7b")) == pytest.approx(46.7e9, rel=2e-3)
    assert total_params(get_model("deepseek-v3")) == pytest.approx(671e9, rel=5e-3)
    assert total_params(get_model("tiny")) == ModelConfig().num_params()
    for name, cfg in MODEL_PRESETS.items():
        assert total_params(get_model(name)) == cfg.num_params(), name


TINY = ModelConfig()  # shardwise's `tiny` preset, whatever its current shape


def tiny_local_params_tp2() -> tuple[int, int]:
    """(params, of which 1-D norm weights) on one tp=2 rank of `tiny`, counted by hand from its shape."""
    h, L, hd = TINY.dim, TINY.n_layers, TINY.head_dim
    vocab_rows = -(-TINY.vocab_size // 2)  # padded to a multiple of tp, half per rank
    layer = (TINY.n_heads // 2) * hd * h * 2 + (TINY.n_kv_heads // 2) * hd * h * 2 + 3 * h * (TINY.ffn_dim // 2) + 2 * h
    return 2 * vocab_rows * h + L * layer + h, (2 * L + 1) * h


def test_tp_shards_and_pads_vocab():
    spec = get_model("tiny")
    local = stage_params(spec, stages(spec, planned(tp=2))[0], planned(tp=2))
    total, norms = tiny_local_params_tp2()
    assert local.total == total and local.sp_replicated == norms == local.vectors


# --- memory --------------------------------------------------------------------------------------

def test_more_tp_less_static_memory():
    spec = get_model("llama3-70b")
    static = [static_of(spec, planned(tp=t, dp=8, zero=1))["total"] for t in (1, 2, 4, 8)]
    assert static == sorted(static, reverse=True) and len(set(static)) == 4


def test_zero1_divides_optimizer_state_by_dp():
    spec = get_model("llama3-8b")
    z0 = static_of(spec, planned(dp=8, tp=2, zero=0))
    z1 = static_of(spec, planned(dp=8, tp=2, zero=1))
    assert z0["optimizer"] / z1["optimizer"] == pytest.approx(8, rel=1e-6)
    assert z0["weights"] == z1["weights"] and z0["grads"] == z1["grads"]


def test_sequence_parallel_reduces_activations():
    spec = get_model("llama3-70b")
    assert activation_of(spec, planned(tp=8, sequence_parallel=True)) < activation_of(spec, planned(tp=8, sequence_parallel=False))


def test_recompute_order():
    spec = get_model("llama3-8b")
    act = {r: activation_of(spec, planned(tp=4, recompute=r)) for r in ("none", "selective", "full")}
    assert act["full"] < act["selective"] < act["none"]


GPT = ModelSpec(name="gpt", vocab_size=51200, dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, head_dim=128,
                ffn_dim=8192, max_seq_len=2048, mlp="gelu", norm="layernorm", dropout=0.1, attn_dropout=0.1)


@pytest.mark.parametrize("t", [1, 8])
def test_korthikanti_activation_formulas(t):
    s, b, h, a = 2048, 4, GPT.dim, GPT.n_heads
    wl = Workload(seq_len=s, precision="bf16")
    def act(**kw):
        return layer_activation_bytes(GPT, False, planned(tp=t, mb=b, **kw), wl, model="korthikanti")
    sbh = s * b * h
    assert act(sequence_parallel=False, recompute="none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert act(sequence_parallel=True, recompute="none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert act(sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert act(sequence_parallel=True, recompute="full") == pytest.approx(2 * sbh / t)


def test_narayanan_flops():
    B, s, l, h, V = 512, 2048, GPT.n_layers, GPT.dim, GPT.vocab_size
    wl = Workload(seq_len=s, global_batch=B)
    assert model_flops(GPT, wl) == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)))
    assert model_flops(GPT, wl, "full") == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))


# --- Hugging Face configs ------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512}


def _write(tmp_path, cfg) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def _llama_count(h, L, heads, kv, hd, ffn, V, tied=False, qkv_bias=False):
    attn = h * heads * hd * 2 + h * kv * hd * 2 + ((heads + 2 * kv) * hd if qkv_bias else 0)
    return L * (attn + 3 * h * ffn + 2 * h) + h + V * h * (1 if tied else 2)


def test_hf_llama_mistral_qwen2(tmp_path):
    spec = load_hf_config(_write(tmp_path, LLAMA))
    assert total_params(spec) == _llama_count(256, 2, 8, 4, 32, 512, 1000)
    spec = load_hf_config(_write(tmp_path, LLAMA | {"model_type": "mistral", "head_dim": 64}))
    assert spec.head_dim == 64 and total_params(spec) == _llama_count(256, 2, 8, 4, 64, 512, 1000)
    spec = load_hf_config(_write(tmp_path, LLAMA | {"model_type": "qwen2", "tie_word_embeddings": True}))
    assert total_params(spec) == _llama_count(256, 2, 8, 4, 32, 512, 1000, tied=True, qkv_bias=True)


def test_hf_mixtral(tmp_path):
    spec = load_hf_config(_write(tmp_path, LLAMA | {"model_type": "mixtral", "num_local_experts": 4,
                                                    "num_experts_per_tok": 2}))
    h, L = 256, 2
    attn = h * 256 * 2 + h * 128 * 2
    assert spec.is_moe and spec.moe_topk == 2
    assert total_params(spec) == L * (attn + 4 * 3 * h * 512 + 4 * h + 2 * h) + h + 2 * 1000 * h


def test_hf_gpt2_small_is_124m(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
    assert total_params(load_hf_config(_write(tmp_path, cfg))) == 124_439_808


def test_hf_errors(tmp_path):
    with pytest.raises(PlanError, match="'bert' is not supported; supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, deepseek_v3, gpt2"):
        load_hf_config(_write(tmp_path, {"model_type": "bert", "hidden_size": 768}))
    with pytest.raises(PlanError, match="'num_hidden_layers' must be a positive integer"):
        load_hf_config(_write(tmp_path, {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}))
    with pytest.raises(PlanError, match="no such file"):
        load_hf_config(tmp_path / "missing.json")


# --- communication, op by op ---------------------------------------------------------------------

def tiny_tp2_sp_expected(b: int, s: int, m: int, r: int = 2) -> dict:
    """The collectives of `tiny`, tp=2 with SP, bf16 (e=2), m microbatches, written out by hand; r is the
    residual stream's bytes (2: bf16 activations, 4: --fp32-residual).

    Per microbatch: embedding RS of b·s·h·r and AG of b·(s/t)·h·r (the embedding output); per layer
    forward 2 AG of the norm output b·(s/t)·h·r + 2 RS of the row-parallel outputs b·s·h·e, backward
    2 AG of b·(s/t)·h·e + 2 RS of the input grads b·s·h·r; LM head AG and RS of its input;
    CE all-reduces of b·s·4 (max) and b·s·2·4 (sum). Per step: one all-reduce of (2L+1)·h·4 norm grads.
    """
    h, L, t, e = TINY.dim, TINY.n_layers, 2, 2
    full, shard = b * s * h, b * (s // t) * h
    rs = m * (full * r + 2 * L * full * (e + r) + full * r)
    ag = m * (shard * r + 2 * L * shard * (r + e) + shard * r)
    ar = m * (b * s * 4 + b * s * 2 * 4) + (2 * L + 1) * h * 4
    return {"tp": {
        "reduce_scatter": {"count": m * (4 * L + 2), "bytes": rs, "wire_bytes": rs * (t - 1) // t},
        "all_gather": {"count": m * (4 * L + 2), "bytes": ag, "wire_bytes": ag * (t - 1)},
        "all_reduce": {"count": 2 * m + 1, "bytes": ar, "wire_bytes": 2 * (t - 1) * ar // t},
    }}


def test_tiny_tp2_sp_comm_ops_by_hand():
    ops = rank0_ledger(get_model("tiny"), planned(tp=2, mb=2, m=2, sequence_parallel=True), Workload(seq_len=64, global_batch=4))
    assert ops == tiny_tp2_sp_expected(b=2, s=64, m=2)
    ops = rank0_ledger(get_model("tiny"), planned(tp=2, mb=2, m=2, sequence_parallel=True),
                       Workload(seq_len=64, global_batch=4, fp32_residual=True))
    assert ops == tiny_tp2_sp_expected(b=2, s=64, m=2, r=4)


def test_tiny_dp_grad_sync_by_zero_stage():
    spec, wl = get_model("tiny"), Workload(seq_len=64, global_batch=4)
    local, vec = tiny_local_params_tp2()
    z0 = rank0_ledger(spec, planned(dp=2, tp=2, mb=2, m=1, zero=0), wl)["dp_cp"]
    assert z0 == {"all_reduce": {"count": 1, "bytes": local * 4, "wire_bytes": local * 4}}
    # ZeRO-1: one flat buffer for matrices, one for norm weights, each padded to a multiple of dp×cp.
    whole = (TINY.num_params(), (2 * TINY.n_layers + 1) * TINY.dim)
    for dp, tp, (n, n_vec) in ((2, 2, (local, vec)), (3, 1, whole)):
        z1 = rank0_ledger(spec, planned(dp=dp, tp=tp, mb=2, m=1, zero=1), Workload(seq_len=64, global_batch=2 * dp))
        padded = -(-(n - n_vec) // dp) * dp + -(-n_vec // dp) * dp
        assert z1["dp_cp"] == {
            "reduce_scatter": {"count": 2, "bytes": padded * 4, "wire_bytes": round(padded * 4 * (dp - 1) / dp)},
            "all_gather": {"count": 2, "bytes": padded // dp * 4, "wire_bytes": padded // dp * 4 * (dp - 1)},
        }


def test_zero0_buckets_like_shardwise():
    """llama3-8b, tp=1: 25 MiB buckets close after the embedding, then per layer after [norm, wq], [wk, wv],
    [wo], [norm, w1], [w3], [w2], and finally [norm, output]: 1 + 32·6 + 1 all-reduces."""
    spec = get_model("llama3-8b")
    ops = rank0_ledger(spec, planned(dp=2, zero=0, m=1), Workload(seq_len=128, global_batch=2))
    assert ops["dp_cp"]["all_reduce"]["count"] == 194
    assert ops["dp_cp"]["all_reduce"]["bytes"] == 4 * total_params(spec)


def test_replicated_kv_heads_all_reduce():
    spec = get_model("llama3-8b")  # 8 KV heads, tp=16: every rank holds one full head
    ops = rank0_ledger(spec, planned(tp=16, sequence_parallel=False, m=1), Workload(seq_len=1024, global_batch=1))
    kv_buf = 8 * 128 * 4096 * 2 * 32 * 4  # n_kv · head_dim · h · (K and V) · L · fp32
    act = 1024 * 4096
    ar = ops["tp"]["all_reduce"]
    assert ar["count"] == 1 + 4 * 32 + 1 + 2 + 1
    assert ar["bytes"] == act * 2 + 2 * 32 * act * (2 + 2) + act * 2 + 1024 * 12 + kv_buf


def test_pp_cp_ep_axes_are_counted():
    spec = get_model("mixtral-8x7b")
    lay = planned(dp=4, tp=2, pp=2, cp=2, ep=4, mb=1, m=4)
    ops = rank0_ledger(spec, lay, Workload(seq_len=4096, global_batch=16))
    # pp: stage 0 sends each microbatch's bf16 activation shard [1, 4096/cp/tp, h]; receives count, 0 bytes.
    assert ops["pp"] == {"send": {"count": 4, "bytes": 4 * 1024 * 4096 * 2, "wire_bytes": 4 * 1024 * 4096 * 2},
                         "recv": {"count": 4, "bytes": 0, "wire_bytes": 0}}
    blk = 2048 * 4 * 128 * 2  # tokens · local KV heads · head dim · e
    # microbatches · layers · (K, V) · (fwd, recomputed fwd under the default selective recompute — the ring
    # is the attention core —, bwd K/V, bwd dK/dV) · (cp − 1)
    sends = 4 * 16 * 2 * 4
    assert ops["cp"] == {"send": {"count": sends, "bytes": sends * blk, "wire_bytes": sends * blk},
                         "recv": {"count": sends, "bytes": 0, "wire_bytes": 0}}
    # ep, per microbatch and MoE layer, under shardwise's tags: the routed rows are topk · s/cp/tp tokens · h;
    # dispatch carries the bf16 norm output, combine the bf16 expert outputs (balanced routing).
    rows, n = 2 * (2048 // 2) * 4096, 4 * 16
    ep = ops["ep"]
    assert ep["all_to_all:counts"] == {"count": n, "bytes": n * 8 * 8, "wire_bytes": n * 8 * 8 * 3 // 4}
    for op, e in (("dispatch", 2), ("combine", 2), ("combine_grad", 2), ("dispatch_grad", 2)):
        assert ep[f"all_to_all:{op}"] == {"count": n, "bytes": n * rows * e, "wire_bytes": n * rows * e * 3 // 4}, op
    # the loss-free-bias counts, once per step per MoE layer, over the token axes (dp×cp and, under SP, tp)
    assert ops["dp_cp"]["all_reduce:moe_bias"]["count"] == ops["tp"]["all_reduce:moe_bias"]["count"] == 16
    assert set(ops) == {"tp", "pp", "cp", "ep", "dp_cp", "edp"}


# --- search and CLI ------------------------------------------------------------------------------

def test_done_when_command(capsys):
    """Issue #6's command: a ranked table of layouts that fit (its "well under a second" is timed by
    benchmarks/plan_speed.py, not here)."""
    assert main(DONE_WHEN) == 0
    out = capsys.readouterr().out
    assert "dp" in out and "MFU" in out and len(out.splitlines()) >= 14
    assert main(DONE_WHEN + ["--json", "--top", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["fits"] and r["total_bytes_per_rank"] <= 0.9 * 80e9 for r in rows)
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)
    assert all(r["layout"]["tp"] <= 8 for r in rows)


def test_explain_json_contract(capsys):
    assert main(DONE_WHEN + ["--explain", "dp=8,tp=8,pp=4", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert CONTRACT_KEYS <= set(est)
    assert set(est["layout"]) == {"dp", "tp", "pp", "cp", "ep", "vp", "mb", "m", "schedule", "zero", "recompute", "sp",
                                  "cp_impl"}
    assert (est["layout"]["dp"], est["layers_per_stage"], est["layout"]["m"]) == (8, 20, 128)
    assert est["bubble_fraction"] == pytest.approx(3 / 131)
    assert est["hardware_flops_per_step"] > est["model_flops_per_step"] > 0
    assert set(est["comm_bytes_per_step"]) == {"tp", "pp", "dp_cp"}
    assert est["comm_links"]["tp"] == "nvlink" and est["comm_links"]["dp_cp"] == "network"
    assert main(DONE_WHEN + ["--explain", "dp=8,tp=8,pp=4"]) == 0
    assert "reduce_scatter" in capsys.readouterr().out


def test_explain_matches_hand_counts_via_cli(capsys):
    argv = ["plan", "--model", "tiny", "--gpus", "2", "--seq-len", "64", "--explain", "tp=2,mb=2,m=2,sp=on", "--json"]
    assert main(argv) == 0
    est = json.loads(capsys.readouterr().out)
    expected = tiny_tp2_sp_expected(b=2, s=64, m=2)
    assert est["comm_ops_per_step"] == expected
    assert est["comm_bytes_per_step"]["tp"] == sum(e["bytes"] for e in expected["tp"].values())


@pytest.mark.parametrize("argv,needle", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "llama3-8b", "--gpu", "v100"], "unknown GPU 'v100'"),
    (["--model", "llama3-70b", "--gpus", "192", "--explain", "tp=3,pp=4"], "tp=3 does not divide n_heads=64"),
    (["--model", "llama3-70b", "--gpus", "256", "--explain", "dp=8,tp=8,pp=3"], "!= 256 GPUs"),
    (["--model", "llama3-70b", "--explain", "tp=8,bogus=1"], "unknown key 'bogus'"),
])
def test_bad_inputs_exit_2_with_one_line(capsys, argv, needle):
    assert main(["plan"] + argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_cli_reads_hf_configs(tmp_path, capsys):
    path = _write(tmp_path, LLAMA)
    assert main(["plan", "--model-config", str(path), "--gpus", "8", "--seq-len", "512", "--global-batch", "64"]) == 0
    assert "layout" in capsys.readouterr().out
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert"}))
    assert main(["plan", "--model-config", str(bert)]) == 2
    assert "model_type 'bert' is not supported" in capsys.readouterr().err


def test_add_parser_registers_plan_on_a_host_cli():
    import argparse

    from shardwise.commands.plan import add_parser, run

    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", "tiny", "--gpus", "2", "--seq-len", "64", "--global-batch", "8"])
    assert args.command == "plan" and args.func is run and run(args) == 0


def test_tp_stays_in_nvlink_domain_unless_allowed():
    # 128 GPUs: on 32 no shardwise layout of 70B fits at seq 4096 (its bf16 autocast saves a weight copy per
    # microbatch in flight and, under SP, a cast of the gathered input per linear; ZeRO-1 keeps grad buffers).
    spec, wl = get_model("llama3-70b"), Workload(seq_len=4096, global_batch=64)
    cluster = Cluster(H100, 128, 8)
    assert max(r["layout"]["tp"] for r in search(spec, cluster, wl)) <= 8
    wide = search(spec, cluster, wl, SearchSpace(allow_tp_cross_domain=True))
    assert max(r["layout"]["tp"] for r in wide) > 8


def test_nvl72_domain_spans_nodes():
    cluster = Cluster(get_gpu("gb200-nvl72"), 144, 4)
    assert cluster.domain == 72
    est = estimate(get_model("llama3-70b"), cluster, planned(dp=2, tp=8, pp=9, m=8), Workload(global_batch=16))
    assert est["comm_links"] == {"tp": "nvlink", "pp": "nvlink", "dp_cp": "network"}
    est = estimate(get_model("llama3-70b"), cluster, planned(dp=9, tp=8, pp=2, m=8), Workload(global_batch=72))
    assert est["comm_links"]["pp"] == "network"  # dp=4's stage pair (ranks 64-79) straddles two racks


def test_moe_search_uses_expert_parallelism():
    rows = search(get_model("mixtral-8x7b"), Cluster(H100, 64, 8), Workload(seq_len=4096, global_batch=256),
                  SearchSpace(micro_batches=(1,)))
    assert rows and any(r["layout"]["ep"] > 1 for r in rows) and all(r["fits"] for r in rows)


def test_planner_imports_no_torch():
    root = Path(__file__).resolve().parents[1] / "shardwise" / "planner"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name


def test_mfu_is_consistent():
    est = estimate(get_model("llama3-8b"), Cluster(H100, 8, 8), planned(dp=8, m=4, mb=4), Workload(global_batch=128),
                   Assumptions(flops_efficiency=0.5))
    assert 0 < est["mfu"] < 0.5
    assert est["mfu"] == pytest.approx(est["model_flops_per_step"] / (est["step_time_s"] * 8 * H100.peak_bf16_flops))


# --- shardwise's own MoE, Ulysses and memory facts (checked against real runs in test_planner_ledger.py) --

def test_tiny_moe_spec_follows_shardwise():
    cfg, spec = MODEL_PRESETS["tiny-moe"], get_model("tiny-moe")
    assert [spec.is_moe_layer(i) for i in range(spec.n_layers)] == [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    assert (spec.moe_experts, spec.moe_topk, spec.expert_ffn_dim, spec.moe_shared_experts, spec.aux_loss) == (8, 2, 128, 1, True)
    lay = planned(pp=2, m=2)
    assert [(s.n_dense, s.n_moe, s.kinds) for s in stages(spec, lay)] == [(2, 2, (True, False, True, False))] * 2
    # The MoE block is replicated over tp (only attention and the dense MLPs are sharded), split over ep.
    moe = lambda tp, ep: layer_params(spec, True, tp, ep)  # noqa: E731
    h, f = spec.dim, spec.expert_ffn_dim
    block = h * spec.moe_experts + 3 * h * f  # router + shared expert
    attention = lambda tp: sum(t.numel for t in attention_tensors(spec, tp))  # noqa: E731
    assert moe(1, 1).total - moe(2, 1).total == attention(1) - attention(2)
    assert moe(1, 2).expert == 3 * 4 * h * f and moe(2, 2).expert == moe(1, 2).expert
    assert moe(2, 2).sp_replicated == 2 * h + block + moe(2, 2).expert  # norms and the whole block sum over tp


def test_ulysses_all_to_alls():
    spec, wl = get_model("tiny"), Workload(seq_len=64, global_batch=2, precision="fp32")
    ops = rank0_ledger(spec, planned(cp=2, cp_impl="ulysses", mb=2, m=1, sequence_parallel=False), wl)
    n = 2 * 64 // 2  # b · s/cp
    q, kv = n * 8 * 12 * 4, n * 4 * 12 * 4  # q (and out): 8 heads of 12; k, v: 4 heads
    # forward q, k, v, out, backward the same four, and (default selective recompute) q, k, v again
    per_layer = 2 * (2 * q + 2 * kv) + q + 2 * kv
    assert ops["cp"] == {"all_to_all": {"count": 8 * 11, "bytes": 8 * per_layer, "wire_bytes": 8 * per_layer // 2}}
    assert parse_layout("cp=2,cp_impl=ulysses", planned(), 2, 2).cp_impl == "ulysses"
    assert any("ulysses needs" in p for p in layout_problems(spec, planned(cp=16, cp_impl="ulysses", m=2), 16, 64))
    assert any("cp_impl 'x'" in p for p in layout_problems(spec, planned(cp_impl="x"), 1, 64))


def test_zero1_grad_buffers_and_break_even():
    """shardwise's ZeRO-1 makes params and .grads views of padded flat buffers and keeps the shard's gradient
    and grad-norm weights, so beyond weights and gradients it costs the padding plus 8·P/g bytes: it breaks
    even at g = 2 (padding aside) and saves memory from g = 3 on."""
    spec = get_model("llama3-8b")
    for g in (2, 3, 4, 8):
        z0, z1 = static_of(spec, planned(dp=g, tp=2, zero=0)), static_of(spec, planned(dp=g, tp=2, zero=1))
        params = z0["weights"] // 4
        assert z0["grad_buffers"] == 0
        assert z1["grad_buffers"] == pytest.approx(8 * params / g, rel=1e-6)
        assert (z1["total"] < z0["total"]) if g > 2 else (z1["total"] >= z0["total"])


def test_activation_model_option(capsys):
    argv = DONE_WHEN + ["--explain", "dp=8,tp=8,pp=4", "--json"]
    assert main(argv) == 0
    shardwise = json.loads(capsys.readouterr().out)
    assert main(argv + ["--activation-model", "korthikanti"]) == 0
    korthikanti = json.loads(capsys.readouterr().out)
    assert (shardwise["assumptions"]["activation_model"], korthikanti["assumptions"]["activation_model"]) == \
        ("shardwise", "korthikanti")
    # shardwise saves fp32 norms, a bf16 cast of the gathered input per linear and a bf16 weight copy per
    # microbatch in flight: several times the paper's figure for Megatron
    assert korthikanti["activation_bytes_per_rank"] < shardwise["activation_bytes_per_rank"] / 2
    assert korthikanti["static_bytes_per_rank"] == shardwise["static_bytes_per_rank"]


def test_recompute_layers_modelled():
    """--recompute-layers N: the first N layers of every chunk are recomputed (`apply_recompute`), the rest are
    not. N = every layer of a chunk is full recompute; fewer layers save more and recompute less (activations,
    the repeated TP collectives, hardware FLOPs between none and full); the row's command spells the flag out
    and --explain reads it back from a train command."""
    from shardwise.commands.train_command import parse_train_flags, train_flags

    spec, wl = get_model("llama3-8b"), Workload(seq_len=4096, global_batch=64)
    base = Layout(dp=2, tp=4, pp=4, m=32, mb=1, zero=1, sequence_parallel=True, recompute="full")
    per_chunk = spec.n_layers // 4
    est = {n: estimate(spec, Cluster(H100, 32, 8), replace(base, recompute_layers=n), wl, detail=True)
           for n in (None, per_chunk, 2)}
    none = estimate(spec, Cluster(H100, 32, 8), replace(base, recompute="none"), wl, detail=True)
    for key in ("activation_bytes_per_rank", "hardware_flops_per_step", "comm_bytes_per_step"):
        assert est[per_chunk][key] == est[None][key], key
    assert est[None]["activation_bytes_per_rank"] < est[2]["activation_bytes_per_rank"] < \
        none["activation_bytes_per_rank"]
    assert none["hardware_flops_per_step"] < est[2]["hardware_flops_per_step"] < est[None]["hardware_flops_per_step"]
    assert none["comm_bytes_per_step"]["tp"] < est[2]["comm_bytes_per_step"]["tp"] < est[None]["comm_bytes_per_step"]["tp"]
    lay = replace(base, recompute_layers=2)
    flags = train_flags(["--model", "llama3-8b"], spec, lay, wl)
    assert flags[flags.index("--recompute-layers") + 1] == "2"
    back, _ = parse_train_flags(" ".join(flags), 32, None, "llama3-8b", spec.n_layers)
    assert back.recompute_layers == 2 and back.recompute == "full"
    st = stages(spec, lay)[0]
    assert st.recomputed == (True, True) + (False,) * (per_chunk - 2)
