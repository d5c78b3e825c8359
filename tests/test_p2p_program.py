"""The p2p program's build: one rank's program without the others', receives posted before their messages
are made when the last stage is the slow one, and a long interleaved program built in linear time."""
import time

from shardwise.pipeline.p2p_check import check_programs
from shardwise.rules.p2p_program import build_program, build_programs, message_in, message_out, messages
from shardwise.rules.schedule_check import simulate
from shardwise.rules.schedules import build_schedule

CASES = [("1f1b", 2, 8, 1), ("interleaved", 2, 8, 2), ("interleaved", 4, 8, 2), ("1f1b", 4, 8, 1), ("zb", 3, 7, 1),
         ("dualpipev", 3, 6, 2), ("gpipe", 3, 4, 1)]


def test_one_rank_program_and_messages_match_the_whole_build():
    for name, p, m, v in CASES:
        s = build_schedule(name, p, m, v)
        programs = build_programs(s)
        ins, outs = messages(s)
        for r in range(p):
            assert build_program(s, r) == programs[r], (name, r)
            assert ins[r] == [message_in(s, r, a) for a in s.actions[r]]
            assert outs[r] == [message_out(s, r, a) for a in s.actions[r]]


def _late_receives(s, programs, slow: float) -> int:
    """Receives posted after their message was made, in a run where the last rank is `slow` times slower."""
    costs = [{"F": 1.0, "B": 1.0}] * (s.p - 1) + [{"F": slow, "B": slow}]
    timeline = simulate(s, rank_costs=costs).timeline
    _, outs = messages(s)
    made = {o[1]: timeline[r][i][2] for r in range(s.p) for i, o in enumerate(outs[r]) if o and o[0] != r}
    late = 0
    for r, prog in enumerate(programs):
        for j, bnd in enumerate(prog):
            posted_at = timeline[r][j - 1][2] if j else 0.0
            late += sum(op.kind == "recv" and posted_at > made[op.key] for ops in bnd.batches for op in ops)
    return late


def test_receives_wait_for_their_messages_when_the_last_stage_is_slower():
    """Posting order by the producers' end: the slower last stage has its receives up before the payloads leave
    (a start-time order posted 6 of 1F1B's and 17 of interleaved's receives late here)."""
    for name, p, m, v in [("1f1b", 2, 8, 1), ("interleaved", 2, 8, 2), ("1f1b", 4, 8, 1)]:
        s = build_schedule(name, p, m, v)
        programs = build_programs(s)
        assert check_programs(programs) is None
        for slow in (1.0, 1.15, 1.3):
            assert _late_receives(s, programs, slow) == 0, (name, p, slow)


def test_long_interleaved_program_builds_in_linear_time():
    """pp 64, v 2: one rank's program for 4× the microbatches (4× the actions) costs about 4× the CPU, not the
    16× of the quadratic search for each receive's boundary that it replaced (3 CPU-s at m 128, 12.8 at m 512).
    A ratio of CPU times, each the best of three, so a loaded machine moves both alike."""
    def cpu(m):
        s = build_schedule("interleaved", 64, m, 2)
        best = float("inf")
        for _ in range(3):
            t = time.process_time()
            prog = build_program(s, 5)
            best = min(best, time.process_time() - t)
        assert len(prog) == len(s.actions[5]) + 1
        return best

    small, large = cpu(64), cpu(256)
    assert large < 8 * small, (small, large)
