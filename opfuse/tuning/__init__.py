"""Tuning: launch configs per kernel, and template against library (or split form) per anchor group.

    cache.py        measured configs and variant choices by kernel signature, on disk
    candidates.py   what is tried for each kernel kind
    pool.py         killable worker processes that compile and time candidates (`python -m
                    opfuse.tuning.pool`; imports neither torch nor triton in the parent)
    configs.py      per-kernel tuning: precompile in parallel, time, keep the fastest that agrees
    orchestrate.py  the compiler's tuning stage: a TuningResult from a plan builder, never an edit
                    of the fusion plan

This package's __init__ imports nothing, so a worker process starts with only what it needs.
"""
