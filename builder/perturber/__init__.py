"""``lance-cf perturber``: try, collect, train and evaluate the caption perturber."""
