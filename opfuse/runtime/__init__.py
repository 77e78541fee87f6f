"""Runs a plan: generated kernels and per-op torch kernels for unfused nodes."""
