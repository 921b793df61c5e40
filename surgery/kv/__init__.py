"""The K/V-head kind (`surgery convert --to mqa|gqa`): `kind` (its options, rules and cost model, registered in
surgery/kinds) and its converters.

Modules: `pool` (pooling K/V heads; splitting/joining fused projections is surgery.fused_qkv), `convert` (the plain
merges, mean/first/random, as streamed tensor surgery, and the planner and writer the aligned merge reuses),
`aligned/` (the activation-aware, RoPE-compatible merge, `--merge aligned`), `refusals` (the families and
configurations the merges refuse). `surgery compare-merges` (every merge method side by side) is
surgery/commands/compare_merges.py.
"""
