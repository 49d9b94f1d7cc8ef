"""CLIP (Radford et al., ICML 2021): the project's one loader and LANCE's quality gates."""
