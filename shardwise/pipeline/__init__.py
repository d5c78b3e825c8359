"""Pipeline parallelism: the executor (`runtime`) runs a schedule, which is data (`shardwise.rules.schedules`,
checked without processes by `shardwise.rules.schedule_check`), over the p2p program (`p2p_program`); `cli` draws
and inspects schedules from the command line."""
