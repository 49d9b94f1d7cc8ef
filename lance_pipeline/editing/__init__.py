"""Real-image editing (LANCE, section 3.2): inversion, attention control, prompt-to-prompt, candidate selection, the image stages, their options and Stable Diffusion components."""
