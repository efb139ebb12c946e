"""Fixtures shared by tests across tiers (registered by tests/conftest.py)."""

from __future__ import annotations
