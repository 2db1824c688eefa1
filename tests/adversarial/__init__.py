"""Adversarial tests: hostile peers, strangers and exhausting clients against the network-facing parts (real processes, loopback only)."""
