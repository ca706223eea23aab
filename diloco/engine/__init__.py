"""The engine: learners, the outer merger and the evaluator, composed from storage/ and training/.

Plain Python with no Prefect import: flows/ and tasks/ wrap it, tests drive it directly.
"""
