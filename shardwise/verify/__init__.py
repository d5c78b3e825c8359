"""`shardwise verify`: a layout against the single-device model, step by step (`main`: the run and its verdict).
`side_by_side` steps the layout and its reference (`reference`) together and `compare` measures them; `checks` holds
each check with its bound and reason; the references' own rounding sets two budgets (`fp64_budget`, `bf16_budget`);
`adam_response` is the update a gradient difference explains; MoE routes the reference where the layout routed
(`routing_replay`)."""
