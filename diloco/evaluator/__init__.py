"""The evaluator role: the held-out loss of committed versions, beside the learner and the merger."""
