"""Subcommands that compose several packages: `plan` (the planner's rows as train commands, `--trace` through
`simulate`) and the Hugging Face commands (`hf-compare`, `hf-export`, which run a trainer against transformers).
A command that needs only its own package keeps its CLI there (`pipeline/cli.py`, `checkpoint/cli.py`, ...);
nothing below this package imports it."""
