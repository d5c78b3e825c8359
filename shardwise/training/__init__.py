"""The training run: flags assembled into the final config (`assemble`), the launcher (`launch`), one rank's
step (`trainer`), the loop with evaluation and checkpoints (`loop`), and what the run writes (`writer`,
`run_dir`, `console`, `observe`, `report`); `generate` samples from a run's checkpoint."""
