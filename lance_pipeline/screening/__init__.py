"""Screens of what a build releases: edits that change a perceived protected attribute of a person
(``sensitive_edits``) and images Stable Diffusion's safety checker flags (``safety_checker``).

LANCE (Prabhu et al., NeurIPS 2023, "Ethical Issues") found that edits can change the perceived gender, race, age,
religion or body of the people in an image (woman -> lifeguard also made the person muscular and male), and its
authors inspected the whole dataset by hand for such edits. These stages mark every such edit, and every unsafe
image, in the release's own data so that a reviewer (``lance-cf review``) and every user of the release can see them.
"""
