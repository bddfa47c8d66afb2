"""Shared fixtures for the qsched test suite."""
