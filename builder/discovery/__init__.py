"""Failure discovery's command, run, report and the ``discovery:`` source."""
