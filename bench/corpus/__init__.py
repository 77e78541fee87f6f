"""The corpus: 150+ real architectures, exported both ways, compiled and verified (README.md)."""
