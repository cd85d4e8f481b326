"""ckptless.launcher: `ckptless-run`, the torchrun-compatible launcher and node agent."""
