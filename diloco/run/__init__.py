"""A run in the bucket: its context, events, stop signals, tensor objects, the evaluator."""
