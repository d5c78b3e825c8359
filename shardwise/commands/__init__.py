"""Subcommands that compose several packages or must not load their package's torch code to parse flags: `plan`
(the planner's rows as train commands, `--trace` through `simulate`), the Hugging Face commands (`hf-compare`,
`hf-export`, which run a trainer against transformers) and `checkpoint` (its package imports torch; the CLI only
when it runs). A command whose package is torch-free at import keeps its CLI there (`pipeline/cli.py`,
`data/cli.py`); nothing below this package imports it."""
