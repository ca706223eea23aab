"""Chaos engineering: fault plans, their injection into a supervised run, and goodput accounting.

Contract: faults are injected into real processes and the real store; everything is recorded as
events in the bucket, from which goodput and the timeline are computed.
"""
