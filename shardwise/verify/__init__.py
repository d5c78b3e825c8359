"""`shardwise verify`: a layout against the single-device model, step by step (`main`), with the reference
routed where the layout routed (`routing_replay`)."""
