"""Dataset interfaces' commands and source: ``lance-cf interfaces`` and the ``generate:`` source."""
