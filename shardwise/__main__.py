"""`python -m shardwise` is the `shardwise` command."""
import sys

from .cli import main

sys.exit(main())
