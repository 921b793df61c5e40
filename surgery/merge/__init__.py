"""Activation-aware, RoPE-compatible K/V-head merging (`surgery convert --to mqa|gqa --merge aligned`)."""
