"""The HTTP layer: dependencies (deps.py) and one router module per resource (routes/)."""
