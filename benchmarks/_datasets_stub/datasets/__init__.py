"""A stand-in for the `datasets` package, used by benchmarks/bench_trl_step.py and gpu_check.sh's
bench-trl stage (TRL's kernel module imports trl.trainer.utils), and only where `import datasets` fails.

Why it exists: TRL 1.16 imports `datasets` at import time (trl.trainer.utils, trl.data_utils,
trl.trainer.base_trainer and the trainers all name its classes), so TRL cannot be imported without
it; some GPU machines have no `datasets` (its pyarrow dependency is too large to install there). The
benchmark hands DistillationTrainer a map-style torch Dataset, never a `datasets` object, so all
TRL, transformers and accelerate do with these names is `isinstance(x, datasets.Dataset)` and the
like, which must be False: the classes below are empty and refuse to be built. Anything that would
really use `datasets` (loading, mapping, concatenating) raises instead of pretending.
"""

STAND_IN = True  # how bench_trl_step.py tells this module from the real package
__version__ = "0.0.0+stand-in"


class _NotAvailable:
    def __init__(self, *args, **kwargs):
        raise ImportError(f"{type(self).__name__}: the `datasets` package is not installed (this is a stand-in)")


class Dataset(_NotAvailable):
    pass


class IterableDataset(_NotAvailable):
    pass


class DatasetDict(_NotAvailable):
    pass


class IterableDatasetDict(_NotAvailable):
    pass


def _unavailable(*args, **kwargs):
    raise ImportError("the `datasets` package is not installed (this is a stand-in)")


load_dataset = load_from_disk = concatenate_datasets = interleave_datasets = _unavailable
