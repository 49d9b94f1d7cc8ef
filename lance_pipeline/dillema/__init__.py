"""DILLEMA (Baresi et al., 2025): its LLM text stages and the ControlNet regeneration editor."""
