"""Evaluation of dataset-interfaces releases: the per-shift metric and its results section."""
