"""Helpers for tests: running a function on several CPU ranks over gloo."""
