"""The LANCE method's stages (Prabhu et al., NeurIPS 2023), one self-contained file per stage.

Stages take and return plain records (see ``lance_pipeline.stage``); they never touch shards, the ledger or the Hub.
"""
