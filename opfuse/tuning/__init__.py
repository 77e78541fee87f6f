"""Tuning: launch configs per kernel, and template against library per anchor group.

pool.py: killable worker processes that compile and time candidates (`python -m opfuse.tuning.pool`).
This package's __init__ imports nothing, so a worker process starts with only what it needs.
"""
