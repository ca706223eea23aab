"""diloco: Decoupled DiLoCo on object storage.

Learners and the outer merger only ever talk to a bucket; Prefect schedules them.
"""

__version__ = "0.1.0"
