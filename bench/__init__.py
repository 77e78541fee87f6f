"""GPU benchmark harness: the zoo, the peers, and one table per run (see bench/RESULTS.md)."""
