"""Fixtures for the end-to-end tests (see harness.py)."""

from .harness import sim_up_factory, up_factory  # noqa: F401  (a pytest fixture, found by name)
