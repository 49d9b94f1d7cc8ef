"""The build machinery: sources, build configs, the ledger, shards, manifest, verify and publish.

``import builder`` is light: model libraries are imported only by the stages that need them.
"""
