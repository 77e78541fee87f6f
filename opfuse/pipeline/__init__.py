"""The compile pipeline as stages (docs/design.md, "The pipeline as stages").

    context.py  CompileContext: each stage's progress (STAGES) and timing (report["timings_s"])
    builder.py  PlanBuilder: the fused plan from the groups, variants, tuned configs and unsafe groups
    stages.py   one function per stage, each with a narrow input and output

opfuse/compiler.py's `_compile` runs them in order; verification and rollback live in
opfuse/verify/, tuning in opfuse/tuning/, report assembly in opfuse/report.py.
"""
