"""Training data and LoRA finetuning for LANCE's structured caption perturber."""
