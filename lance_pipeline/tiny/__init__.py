"""Tiny random-weight (or deterministic stand-in) components for the offline demo presets and the tests."""
