"""``lance-cf verify`` checks a release with the release format's own verifier (:mod:`builder.release_format.verify`)."""

from builder.release_format.verify import MAX_PROBLEMS, verify_release

__all__ = ["MAX_PROBLEMS", "verify_release"]
