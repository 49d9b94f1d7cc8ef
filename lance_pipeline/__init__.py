"""The methods: the stage contract and one folder per system.

- ``stage`` (the contract between builder and stages), ``registry`` (the one registry class; editors and inversion
  methods), ``devices`` (which torch device a command uses): shared by every system.
- ``text/``: LANCE's text stages (captioning, perturbation, label checks, LANCE-R, edit spans).
- ``clip/``: the one CLIP loader and LANCE's quality gates.
- ``editing/``: real-image editing (inversion, attention control, prompt-to-prompt, candidate selection, the image
  stages and their options, Stable Diffusion components).
- ``dillema/``: DILLEMA's text stages and the ControlNet editor.
- ``interfaces/``: dataset interfaces / ImageNet* (shifts, class tokens, generation and its filter).
- ``discovery/``: failure discovery (Wiles et al.).
- ``perturber/``: training data and LoRA finetuning of the caption perturber.
- ``tiny/``: tiny random-weight components and deterministic stand-ins for the offline demos and the tests.

Stages take and return plain records (see ``lance_pipeline.stage``); they never touch shards, the ledger or the Hub.
"""
