"""`shardwise simulate`: real ranks of a large layout run in one process on fake tensors, measured against
the planner (see `world` and `cli`)."""
