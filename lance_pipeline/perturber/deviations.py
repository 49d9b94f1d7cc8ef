"""Where perturber training departs from LANCE's (Prabhu et al., NeurIPS 2023): a table of ``lance_pipeline.deviations``
that reaches the docs and the adapter's model card, never a dataset card (training makes no release); the LANCE release
kind lists it."""

from __future__ import annotations

from lance_pipeline.deviations import Deviation, DeviationTable

PERTURBER_ROWS = (
    Deviation(
        "perturber",
        "base model",
        "LLaMA-7B (LLaMA-1)",
        "any transformers causal LM, named by the user",
        "LLaMA-1 weights are under a research licence and not on the Hub in transformers form",
        "`--model`",
    ),
    Deviation(
        "perturber",
        "LoRA placement",
        "one rank-8 update of the concatenated query, key and value matrix per layer",
        "a rank-8 update of each of the q, k and v projections (one fused update where the model fuses them, as "
        "GPT-2's `c_attn`)",
        "PEFT adapts the projections a model has; most current models keep q, k, v separate",
        "`--target-modules`",
    ),
    Deviation(
        "perturber",
        "data",
        "0.6k GPT-3.5 edits of MSCOCO captions (section 3.1)",
        "whatever `lance-cf perturber collect` gathered from the teacher the user chose",
        "neither the data nor the collection script was released",
        "`perturber collect --teacher`, `--captions-*`",
    ),
    Deviation(
        "perturber",
        "loss",
        "not given (lit-llama's Alpaca recipe, whose defaults the paper's numbers match, trains on the prompt too)",
        "the answer tokens only",
        "the prompt is the same for every row of a type; learning it teaches nothing about editing",
        "`--train-on-prompt`",
    ),
)


PERTURBER_DEVIATIONS = DeviationTable(
    "perturber",
    "Perturber training (`lance-cf perturber train`)",
    "Prabhu et al., NeurIPS 2023: section 3.1, Implementation details, Table 6",
    PERTURBER_ROWS,
    releases=False,
)
