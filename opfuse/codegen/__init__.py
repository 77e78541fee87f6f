"""Triton source for each group kind. Generated identifiers only; model text only in escaped comments."""

from __future__ import annotations
