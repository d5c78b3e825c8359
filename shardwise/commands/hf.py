"""`shardwise hf-compare` and `shardwise hf-export`: Hugging Face checkpoints against any layout.

hf-compare loads a local HF directory into the requested layout (every rank reading only its
slices), runs one forward on seeded random token ids, gathers the logits (vocabulary over TP,
sequence over CP, batch over DP; the last pipeline stage holds them) and compares them with
transformers' own forward of the same directory. Its last stdout line is one JSON object with
`max_abs_diff` and `passed`; exit 0 only when passed, 1 when not (or a rank failed), 2 for bad
input. transformers is imported only here, after the ranks finished, in the parent process.

hf-export writes a shardwise checkpoint (any layout; it is read whole in one process) as an HF
directory that `AutoModelForCausalLM.from_pretrained` loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING

from ..config import ConfigError, ParallelConfig, TrainConfig
from ..training.assemble import assemble

if TYPE_CHECKING:
    import torch


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("hf-compare", help="check an HF checkpoint's logits on a layout against transformers",
                              description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", metavar="DIR", help="local HF model directory (config.json + *.safetensors)")
    g = p.add_argument_group("layout")
    for axis, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")):
        g.add_argument(f"--{axis}", type=int, default=1, help=f"{what}-parallel degree")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism in TP regions")
    g.add_argument("--schedule", default="1f1b", help="pipeline schedule (decides which stages a rank holds)")
    g.add_argument("--vp", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    g.add_argument("--pp-layers", default=None, help="layers per stage, comma-separated (pp × vp counts)")
    g.add_argument("--cp-order", default="balanced", help="context-parallel token order: balanced or contiguous")
    g.add_argument("--cp-impl", default="ring", help="context-parallel attention: ring or ulysses")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences (split over dp)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--atol", type=float, default=1e-4,
                   help="passes when max |diff| <= atol × max(1, max |reference logit|) (fp32)")
    p.add_argument("--collective-timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    p.set_defaults(func=run)
    e = subparsers.add_parser("hf-export", help="write a shardwise checkpoint as a Hugging Face directory")
    e.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a checkpoint root (newest intact step) or one step-N dir")
    e.add_argument("out_dir", metavar="OUT", help="new or empty folder for the model, its tokenizer and "
                   "generation_config.json")
    e.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="byte, a tokenizer.json or a folder holding one (default: the one the run trained with)")
    e.add_argument("--overwrite", action="store_true", help="replace the model in a non-empty OUT")
    e.set_defaults(func=run_export)
    return p


def layout_config(hf_dir: str, parallel: ParallelConfig, seq_len: int, batch: int, timeout_s: float = 120.0):
    """TrainConfig of the layout for `hf_dir`'s model, validated like `shardwise train` (ConfigError)."""
    from ..hf.config import config_from_hf

    model = config_from_hf(hf_dir)
    dp = parallel.dp
    if batch <= 0 or batch % dp:
        raise ConfigError(f"--batch {batch} must be a positive multiple of --dp {dp}")
    # Only the schedule's stage layout matters for a forward; 2·pp microbatches satisfy every schedule.
    cfg = TrainConfig(model=model, parallel=parallel, steps=1, seq_len=seq_len, micro_batch=batch // dp,
                      global_batch=batch * 2 * parallel.pp, timeout_s=timeout_s, progress=False)
    return assemble(cfg)


def _pipeline_forward(model, mesh, x, schedule, act_shape):
    """Stage by stage over blocking p2p (every rank walks the stages in the same order); logits or None."""
    import torch  # lazy: `shardwise plan` must not pay for torch

    from .. import comm

    pp, lay = mesh["pp"], schedule.layout
    h = None
    for stage in range(lay.num_stages):
        owner, chunk = lay.owner(stage)
        if owner == pp.rank:
            h = model.chunks[chunk](x if stage == 0 else h)
        if stage + 1 == lay.num_stages:
            return h if owner == pp.rank else None
        nxt = lay.owner(stage + 1)[0]
        if nxt == owner:
            continue
        if pp.rank == owner:
            comm.wait(comm.p2p([("send", h.contiguous(), pp, nxt)])[0], pp, f"send of stage {stage}'s output")
        elif pp.rank == nxt:
            h = torch.empty(act_shape, dtype=torch.float32, device=mesh.device)
            comm.wait(comm.p2p([("recv", h, pp, owner)])[0], pp, f"recv of stage {stage}'s output")


def rank_forward(cfg: TrainConfig, hf_dir: str, tokens: torch.Tensor) -> dict:
    """On one rank: build the layout, load `hf_dir`, forward this dp rank's share; global logits on one rank."""
    import torch  # lazy: `shardwise plan` must not pay for torch

    from .. import comm
    from ..context_parallel.sharding import shard_sequence, unshard_sequence
    from ..hf.weights import load_hf_into
    from ..parallelize import build_model
    from ..training.trainer import make_mesh

    p, model_cfg = cfg.parallel, cfg.model_config()
    mesh = make_mesh(cfg, torch.device("cpu"))
    schedule = None
    if p.pp > 1:
        from ..rules.schedules import build_schedule

        schedule = build_schedule(p.schedule, p.pp, cfg.grad_accum, p.vp)
    model = build_model(model_cfg, mesh, cfg.seed, p, schedule=schedule)
    model.eval()
    stats = load_hf_into(model, hf_dir, mesh)
    dp, cp, tp = mesh["dp"], mesh["cp"], mesh["tp"]
    per = tokens.shape[0] // dp.size
    x = shard_sequence(tokens[dp.rank * per:(dp.rank + 1) * per], cp.rank, cp.size, p.cp_order)
    with torch.no_grad():
        if schedule is None:
            logits = model(x)
        else:
            s_local = x.shape[1] // (tp.size if p.sequence_parallel else 1)
            logits = _pipeline_forward(model, mesh, x, schedule, (per, s_local, model_cfg.dim))
        if logits is not None:  # every rank of the last stage: gather vocabulary, then sequence, then batch
            logits = comm.all_gather(logits, tp, dim=2)[..., :model_cfg.vocab_size]
            if cp.active:
                parts = comm.all_gather(logits, cp, dim=1).chunk(cp.size, dim=1)
                logits = unshard_sequence(list(parts), cp.size, p.cp_order)
            logits = comm.all_gather(logits, dp, dim=0)
    keep = logits is not None and tp.rank == 0 and cp.rank == 0 and dp.rank == 0
    return {"rank": mesh.rank, "logits": logits if keep else None, **stats}


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits for `tokens` (imported here only: a test-time dependency)."""
    import torch  # lazy: `shardwise plan` must not pay for torch

    import transformers

    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **kw)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def compare(hf_dir: str, parallel: ParallelConfig, seq_len: int = 32, batch: int = 2, seed: int = 0,
            atol: float = 1e-4, timeout_s: float = 120.0) -> dict:
    """Load `hf_dir` into the layout, compare its logits with transformers'; the hf-compare result."""
    import torch  # lazy: `shardwise plan` must not pay for torch

    from ..training.launch import run_local

    cfg = layout_config(hf_dir, parallel, seq_len, batch, timeout_s)
    world = cfg.resolve_world()
    vocab = cfg.model_config().vocab_size
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    if world == 1:
        results = [rank_forward(cfg, hf_dir, tokens)]
    else:
        results = run_local(rank_forward, world, cfg, hf_dir, tokens, timeout_s=timeout_s)
    ours = next(r["logits"] for r in results if r["logits"] is not None)
    ref = hf_logits(hf_dir, tokens)
    if ours.shape != ref.shape:
        raise RuntimeError(f"logits shape {tuple(ours.shape)} differs from transformers' {tuple(ref.shape)}")
    diff = float((ours - ref).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    return {"model": cfg.model_config().name, "layout": parallel.as_dict(), "seq_len": seq_len, "batch": batch,
            "max_abs_diff": diff, "max_ref_abs": float(ref.abs().max()), "tolerance": atol * scale,
            "bytes_read_per_rank": [r["bytes_read"] for r in results], "passed": diff <= atol * scale,
            "logits": ours}


def run(args) -> int:
    try:
        pp_layers = [int(c) for c in args.pp_layers.split(",")] if args.pp_layers else None
    except ValueError:
        print(f"shardwise hf-compare: error: --pp-layers {args.pp_layers!r} must be comma-separated integers",
              file=sys.stderr)
        return 2
    parallel = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                              sequence_parallel=args.sequence_parallel, schedule=args.schedule, vp=args.vp,
                              pp_layers=pp_layers, cp_order=args.cp_order, cp_impl=args.cp_impl)
    from ..training.launch import RankError

    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"shardwise hf-compare: error: needs safetensors and transformers ({e})", file=sys.stderr)
        return 2
    try:
        result = compare(args.hf_dir, parallel, args.seq_len, args.batch, args.seed, args.atol,
                         args.collective_timeout)
    except (ConfigError, FileNotFoundError) as e:
        print(f"shardwise hf-compare: error: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        print(f"shardwise hf-compare: {e}", file=sys.stderr)
        return 1
    result.pop("logits")
    print(json.dumps(result))
    return 0 if result["passed"] else 1


def run_export(args) -> int:
    """hf-export: weights, config.json, tokenizer files and generation_config.json; exit 2 on bad input."""
    from .. import checkpoint as ck
    from ..config import ModelConfig
    from ..hf.weights import export_hf, need_safetensors
    from ..hf.export import multimodal_source, prepare_out_dir, record_from_flag, record_from_run_dir, text_source
    from ..paths import check_writable

    try:
        need_safetensors("hf-export")
        check_writable(args.out_dir, "OUT")
        prepare_out_dir(args.out_dir, getattr(args, "overwrite", False))
    except ConfigError as e:
        print(f"shardwise hf-export: error: {e}", file=sys.stderr)
        return 2
    path, skipped = ck.newest_intact(args.ckpt_dir)
    if path is None:
        why = "; ".join(f"{p}: {r}" for p, r in skipped) or "no step-N directories"
        print(f"shardwise hf-export: error: no intact checkpoint under {args.ckpt_dir} ({why})", file=sys.stderr)
        return 2
    with open(f"{path}/{ck.META}") as f:
        meta = json.load(f)
    saved = meta["model"]
    known = {fl.name for fl in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known})
    try:
        spec = getattr(args, "tokenizer", None)
        tokenizer = record_from_flag(spec) if spec else meta.get("extra_state", {}).get("tokenizer") \
            or record_from_run_dir(os.path.dirname(path))
        state = ck.load_global_tensors(path)
        state.update(ck.load_global_tensors(path, prefix="buffer."))  # DeepSeek-V3's selection bias rides along
        multimodal, written = multimodal_source(os.path.dirname(path))
        source, kept = text_source(os.path.dirname(path))
        written = written or kept
        export_hf(state, cfg, args.out_dir, tokenizer, multimodal=multimodal, hf_source=source)
    except (ConfigError, ValueError, KeyError) as e:
        print(f"shardwise hf-export: error: {e}", file=sys.stderr)
        return 2
    what = "config.json, model.safetensors" + (", tokenizer, generation_config.json" if tokenizer else
                                               "; no tokenizer recorded: pass --tokenizer SPEC to add one")
    what += f"; {written}" if written else ""
    print(f"wrote {args.out_dir} ({what}) from {path}")
    return 0
