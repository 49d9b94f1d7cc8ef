"""Dataset cards for LANCE counterfactual releases, rendered from a release's manifest (and evaluation results)."""

from dataset_cards.card import render_release_card

__all__ = ["render_release_card"]
