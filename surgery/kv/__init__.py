"""The K/V-head kind's converters (`surgery convert --to mqa|gqa`; the kind itself is `surgery/kv/kind.py`).

Modules: `pool` (pooling K/V heads, and splitting/joining fused projections around it), `convert` (the plain
merges, mean/first/random, as streamed tensor surgery, and the planner and writer the aligned merge reuses),
`aligned/` (the activation-aware, RoPE-compatible merge, `--merge aligned`), `refusals` (the families and
configurations the merges refuse). `surgery compare-merges` (every merge method side by side) is
surgery/commands/compare_merges.py.
"""
