"""`python -m shardwise.planner plan ...`: the planner without the rest of shardwise's CLI."""
import sys

from shardwise.planner.cli import main

sys.exit(main())
