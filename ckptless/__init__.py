"""ckptless: checkpointless peer-to-peer recovery for PyTorch distributed training."""

from ckptless import errors

__version__ = "0.1.0"
__all__ = ["errors", "__version__"]
