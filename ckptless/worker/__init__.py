"""ckptless.worker: what runs inside a training process launched by ``ckptless-run``."""
