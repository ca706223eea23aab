"""diloco: Decoupled DiLoCo on object storage.

Learners and the outer merger only ever talk to a bucket; Prefect schedules them.
"""

__version__ = "0.2.0"
__all__ = ["RunFailed", "TrainSpec", "train"]


def __getattr__(name: str) -> object:
    """`diloco.TrainSpec`, `diloco.train` and `diloco.RunFailed`, imported on first use (so `import
    diloco.cli` stays light)."""
    if name == "TrainSpec":
        from diloco.training.spec import TrainSpec

        return TrainSpec
    if name == "train":
        from diloco.api import train

        return train
    if name == "RunFailed":
        from diloco.inspect.outcome import RunFailed

        return RunFailed
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
