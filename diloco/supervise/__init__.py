"""Supervisors: start every role of a run, watch, heal, stop."""
