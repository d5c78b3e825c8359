"""Surviving a lost rank: copies of each rank's training state in host memory (its own node's and a peer node's),
and the recovery that resumes a restarted worker group from the newest consistent state (docs/fault-tolerance.md).

Modules by idea: `peers` (which node holds whose copy; pure), `store` (a node's copies in shared memory that
outlive the worker processes, and each rank's progress record), `snapshot` (one rank's state as one byte tensor,
and back), `memory` (the copy every N steps over the `ckpt` group), `recover` (the newest consistent state: memory
copies or disk), `elastic` (going on with fewer DP replicas and the same global batch, and back: the layout for a
world size, the state re-cut from another layout's copies), `group` (the launcher's worker-group starts: restarts,
survivors, rejoins). Nothing is imported here, so the launcher can read `peers`, `store` and `group` without the
model code.
"""
