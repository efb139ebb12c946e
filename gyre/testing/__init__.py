"""Helpers for tests and the launcher: real service processes on loopback."""
