"""Prefect flows: train (supervisor), learner, outer-merge, evaluate — each a short recipe."""
