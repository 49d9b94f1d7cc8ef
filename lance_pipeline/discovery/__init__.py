"""Failure discovery (Wiles et al., 2022): cluster a model's failures, describe them, test the descriptions."""
