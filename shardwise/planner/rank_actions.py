"""What one pipeline rank's schedule actions say about its memory moments: backwards before its last
forward, each kind of backward and the activations it holds, the split-backward states (the planner's
peak, `planner/peak.py`)."""
from __future__ import annotations

from functools import lru_cache

from shardwise.planner.layout import Layout


def backward_then_forward(lay: Layout, k: int) -> bool:
    """Whether rank k of the pipeline runs a forward after a backward within one step (without a pipeline:
    whether the step has more than one microbatch)."""
    return backwards_before_forward(lay, k) > 0


def backwards_before_forward(lay: Layout, k: int) -> int:
    """How many backwards rank k of the pipeline has run before its last forward of the step."""
    if lay.pp == 1:
        return lay.m - 1
    return _b_before_f(lay.schedule, lay.pp, lay.m, lay.vp, k)


@lru_cache(maxsize=64)
def _schedule(schedule: str, p: int, m: int, v: int):
    """The schedule, built once per (schedule, p, m, v): the search asks about every rank of every layout,
    and building one costs O(p·m·v) actions."""
    from shardwise.rules.schedules import build_schedule

    return build_schedule(schedule, p, m, v)


@lru_cache(maxsize=1024)
def _b_before_f(schedule: str, p: int, m: int, v: int, k: int) -> int:
    try:
        kinds = [a.kind for a in _schedule(schedule, p, m, v).actions[k]]
    except (ImportError, ValueError):
        return m
    last_f = max((i for i, kind in enumerate(kinds) if kind == "F"), default=-1)
    return kinds[:last_f].count("B")


@lru_cache(maxsize=1024)
def backward_states(schedule: str, p: int, m: int, v: int, k: int) -> tuple[tuple[int, bool], ...]:
    """Per kind of backward on rank k — (its first one, one after another backward) — the fewest
    microbatch-chunks held fewer than the rank's most at any F: the first backward of a step runs with the
    most held and nothing in flight; a later one may hold fewer (e.g. 1F1B's cool-down)."""
    try:
        actions = _schedule(schedule, p, m, v).actions[k]
    except (ImportError, ValueError):
        return ((0, False), (0, True))
    held = most = 0
    seen, states = False, {}
    for a in actions:
        if a.kind == "F":
            held += 1
            most = max(most, held)
        elif a.kind == "B":
            states.setdefault(seen, []).append(held)
            held, seen = held - 1, True
    return tuple((most - max(hs), prior) for prior, hs in sorted(states.items()))


@lru_cache(maxsize=1024)
def split_states(schedule: str, p: int, m: int, v: int, k: int) -> tuple[tuple[int, int], ...]:
    """Every (chunks with F done and B not, chunks with B done and W not) rank k passes through."""
    sched = _schedule(schedule, p, m, v)
    if not sched.split_bw:
        return ()
    held = pending = 0
    states = set()
    for a in sched.actions[k]:
        held += a.kind == "F"
        if a.kind == "B":
            held, pending = held - 1, pending + 1
        pending -= a.kind == "W"
        states.add((held, pending))
    return tuple(sorted(states))


@lru_cache(maxsize=64)
def _programs(schedule: str, p: int, m: int, v: int):
    from shardwise.rules.p2p_program import build_programs

    return build_programs(_schedule(schedule, p, m, v))


@lru_cache(maxsize=1024)
def boundary_buffers(schedule: str, p: int, m: int, v: int, k: int, saved_inputs: bool) -> tuple[int, int]:
    """(during an F, during a B or W — before the action's own output or input gradient exists, which the
    peak's moments count as the running action's): the most boundary-sized tensors ([mb, s/cp(/tp under SP), h], the residual's dtype) rank k's executor
    (`pipeline.runtime`) holds beside the saved activations during one action, walked over its actions and its
    p2p program (`rules.p2p_program`):
    * a receive posted at a boundary, until its action takes it;
    * a chunk's input, held in the executor's state from its F to its B (autograd saves it only when the
      residual is fp32, `saved_inputs`: otherwise the block's fp32 norm saves its own cast), then by the loop's
      variable until the next F or B; an output handed to this rank's next chunk (dualpipev's turn), held
      with its producer's state and as that chunk's input;
    * an output or input gradient sent to another rank, until the reap after the next action (the send done);
    * the output gradient a B took, held by the loop's variable until the next B; the input gradient it made,
      as the input's `.grad`, and handed over until the B that takes it."""
    try:
        from shardwise.rules.p2p_program import message_in, message_out

        sched, program = _schedule(schedule, p, m, v), _programs(schedule, p, m, v)[k]
    except (ImportError, ValueError):
        return 2, 2
    inbox, local = set(), set()
    state: dict[tuple, tuple] = {}  # (mb, chunk) -> (input, handed-over output)
    grads: dict[tuple, tuple] = {}  # input -> the input gradient its B made (its .grad)
    var_x = var_out = var_grad = None
    sending: list[tuple] = []  # (buffer, last action index it lives through)
    best = {"F": 0, "B": 0}
    for i, a in enumerate(sched.actions[k]):
        inbox |= {("recv",) + op.key for ops in program[i].batches for op in ops if op.kind == "recv"}
        src, dst = message_in(sched, k, a), message_out(sched, k, a)
        key = (a.microbatch, a.chunk)
        made = None  # what the action makes at its end: F's output, B's input gradient
        incoming = None
        if src is not None:
            incoming = ("recv",) + src[1] if src[0] != k else ("local",) + src[1]
            (inbox if src[0] != k else local).discard(incoming)
        if a.kind == "F":
            var_x, var_out = incoming, None
            if dst is not None and dst[0] == k:
                var_out = made = ("local",) + dst[1]
                local.add(var_out)
            elif dst is not None:
                made = ("out",) + key
                sending.append((made, i + 1))
            state[key] = (var_x, var_out)
        elif a.kind == "B":
            var_x, var_out = state.pop(key)
            var_grad = incoming
            if var_x is not None:
                made = ("local",) + dst[1] if dst is not None and dst[0] == k else ("xgrad",) + key
                grads[var_x] = made
                if dst is not None and dst[0] == k:
                    local.add(made)
                elif dst is not None:
                    sending.append((made, i + 1))
        held = {b for pair in state.values() for b in pair} | inbox | local | {var_x, var_out, var_grad}
        held |= {grads[b] for b in held if b in grads} | {b for b, _ in sending}
        saved = {x for x, _ in state.values()} if saved_inputs else set()
        kind = "F" if a.kind == "F" else "B"
        best[kind] = max(best[kind], len(held - saved - {None, made}))
        sending = [(b, last) for b, last in sending if last > i]
    return best["F"], best["B"]


@lru_cache(maxsize=1024)
def head_held_at_other_backward(schedule: str, p: int, m: int, v: int, k: int) -> bool:
    """Whether rank k runs a B of one of its chunks while a microbatch of its last chunk (on the stage holding the
    LM head: the head's) has its F done and its B not — DualPipeV's rank 0 does (an F of the head's chunk, then a B
    of its first chunk); on 1F1B, zb and interleaved the last rank's B of its last chunk follows that F at once,
    and GPipe's single chunk has no other."""
    try:
        actions = _schedule(schedule, p, m, v).actions[k]
    except (ImportError, ValueError):
        return True
    last = max(a.chunk for a in actions)
    held = 0
    for a in actions:
        if a.chunk == last and a.kind == "F":
            held += 1
        elif a.kind == "B":
            if a.chunk != last and held:
                return True
            held -= a.chunk == last
    return False
