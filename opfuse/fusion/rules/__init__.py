"""opfuse's fusion rules, one module each, every one a `FusionRule` (base.py) named by its entries
in the rule registry (`impl`), which the planner runs in the registry's order."""
