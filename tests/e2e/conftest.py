"""Fixtures for the end-to-end tests (see harness.py)."""

from .harness import up_factory  # noqa: F401  (a pytest fixture, found by name)
