"""Human review of a release: ``lance-cf review``.

Every counterfactual benchmark of the field was checked by people before it was trusted (LANCE's human study,
ImageNet*'s raters, DILLEMA's agreement); this package makes that part of the release.

- ``index``: the release's samples, looked up by (config, key) in an index built with the release format's reader;
  nothing a request names ever reaches the file system.
- ``store``: judgements as data, in SQLite (WAL) under the release's work directory ``.lance-cf/``: each one with its
  reviewer, time, question and answer, appended (going back and judging again adds a row; the latest counts).
- ``study``: what is reviewed and asked: questions, samples per edit type or shift, blind shuffled order per
  reviewer from a seed; agreement (Fleiss' and Cohen's kappa, from statsmodels and scikit-learn).
- ``server``: the review page (Starlette, served by uvicorn on 127.0.0.1 with a random access token).
- ``apply``: ``lance-cf review apply``: the next version of the release with each sample's review.
"""
