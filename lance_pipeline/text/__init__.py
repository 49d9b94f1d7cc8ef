"""LANCE's text stages (Prabhu et al., NeurIPS 2023, section 3.1): captioning, structured caption perturbation, label-preservation checks, LANCE-R's random edits and edit spans."""
