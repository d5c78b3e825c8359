"""Replay every rank's posted p2p program under NCCL's rules, without processes or GPUs.

The rules (what gloo hides and NCCL enforces):
* per rank and communicator one FIFO stream: batched p2p runs as one coalesced group on the group's
  communicator, so a rank's batches are issued in posting order whatever peers they involve, and a
  batch is issued only when it heads its stream (`comm.p2p`'s strict mode waits the same way);
  `streams_per="pair"` is the weaker model of one stream per pair of ranks (unbatched p2p, each pair
  on its own communicator), kept to show what per-peer ordering alone would let through;
* a batch completes only when every one of its ops is matched: the n-th send from a to b with the
  n-th receive on b from a, both in issued batches (their message keys must agree, else the data
  would land in the wrong buffer);
* a blocked batch blocks everything after it on its streams;
* a rank runs its program in order: it posts a boundary's batches without waiting, then waits for
  the batch holding the input of its next action before going on.

`check_programs` returns None when every rank finishes, else a readable report of what is stuck.
"""
from __future__ import annotations

from collections import deque

from ..rules.p2p_program import Boundary


class P2PMismatch(AssertionError):
    """Two matched ops name different messages: on hardware the data would land in the wrong buffer."""


def check_programs(programs: list[list[Boundary]], streams_per: str = "rank") -> str | None:
    """None if the programs complete under NCCL's rules; otherwise which ranks are stuck, on what.

    streams_per="rank": one FIFO stream per rank (all programs are on one group, the pp axis: what
    ProcessGroupNCCL's batched p2p does); "pair": one per rank pair, the weaker model.
    """
    if streams_per not in ("rank", "pair"):
        raise ValueError(f"streams_per {streams_per!r}: expected 'rank' or 'pair'")
    p = len(programs)
    pos = [0] * p                       # next boundary to run per rank
    posted = [False] * p                # whether boundary pos[r] has been posted
    streams: dict[tuple[int, int], deque] = {}   # (rank, peer) -> batch ids in posting order
    batches: dict[int, dict] = {}       # id -> {rank, ops, matched: set(op index)}
    where: dict[tuple[int, tuple], int] = {}     # (rank, message key) -> batch id holding its recv
    sent: dict[tuple[int, int], list] = {}       # (src, dst) -> [(batch id, op index, key)] in order
    recvd: dict[tuple[int, int], list] = {}      # (src, dst) -> [(batch id, op index, key)] in order
    matched_n: dict[tuple[int, int], int] = {}   # (src, dst) -> ops matched so far
    outstanding: list[set[int]] = [set() for _ in range(p)]
    next_id = 0

    def lanes(peers):
        return peers if streams_per == "pair" else (-1,)

    def issued(b: int) -> bool:
        info = batches[b]
        return all(streams[(info["rank"], peer)][0] == b for peer in lanes(info["peers"]))

    progress = True
    while progress:
        progress = False
        for r in range(p):  # post what each rank can post, and get past satisfied waits
            while pos[r] < len(programs[r]):
                bnd = programs[r][pos[r]]
                if not posted[r]:
                    for ops in bnd.batches:
                        b, next_id = next_id, next_id + 1
                        batches[b] = {"rank": r, "ops": ops, "matched": set(), "peers": {op.peer for op in ops}}
                        outstanding[r].add(b)
                        for peer in lanes(batches[b]["peers"]):
                            streams.setdefault((r, peer), deque()).append(b)
                        for k, op in enumerate(ops):
                            pair = (r, op.peer) if op.kind == "send" else (op.peer, r)
                            (sent if op.kind == "send" else recvd).setdefault(pair, []).append((b, k, op.key))
                            if op.kind == "recv":
                                where[(r, op.key)] = b
                    posted[r] = True
                    progress = True
                if bnd.wait is not None and where.get((r, bnd.wait)) in outstanding[r]:
                    break
                if bnd.wait is not None and (r, bnd.wait) not in where:
                    return f"rank {r} waits for {bnd.wait}, which it never posted a receive for"
                pos[r] += 1
                posted[r] = False
                progress = True
        for pair in set(sent) | set(recvd):  # match ops whose batches are both issued, in FIFO order
            s_list, r_list = sent.get(pair, []), recvd.get(pair, [])
            n = matched_n.get(pair, 0)
            while n < len(s_list) and n < len(r_list):
                (bs, ks, key_s), (br, kr, key_r) = s_list[n], r_list[n]
                if not (issued(bs) and issued(br)):
                    break
                if key_s != key_r:
                    raise P2PMismatch(f"pp rank {pair[0]} sends {key_s} where pp rank {pair[1]} receives {key_r}")
                batches[bs]["matched"].add(ks)
                batches[br]["matched"].add(kr)
                n += 1
                progress = True
            matched_n[pair] = n
        for r in range(p):  # complete batches whose every op matched
            for b in [b for b in outstanding[r] if len(batches[b]["matched"]) == len(batches[b]["ops"])]:
                outstanding[r].discard(b)
                for peer in lanes(batches[b]["peers"]):
                    streams[(r, peer)].popleft()
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(programs[r]) or outstanding[r]]
    if not stuck:
        return None
    lines = []
    for r in stuck:
        heads = [batches[b]["ops"] for b in sorted(outstanding[r])][:2]
        at = f"boundary {pos[r]}" if pos[r] < len(programs[r]) else "the end"
        lines.append(f"pp rank {r} stuck at {at} with unfinished batches {heads}")
    return "deadlock under NCCL's p2p rules: " + "; ".join(lines)
