"""Dataset interfaces / ImageNet* (Vendrow et al., 2023): named shifts, class tokens by textual inversion, generation and its CLIP filter."""
