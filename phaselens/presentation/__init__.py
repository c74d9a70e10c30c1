"""Presentation: the generated figure report and the command line, thin over the Python API."""
