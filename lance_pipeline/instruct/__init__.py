"""Instruction editors: LANCE's edits rendered by diffusers' instruction-editing pipelines (``editing.py``)."""
