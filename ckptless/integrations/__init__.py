"""Recovery for training loops that frameworks own: one module per framework.

* :mod:`ckptless.integrations.hf`: Hugging Face ``transformers.Trainer``
  (``ckptless.integrations.hf.train(trainer)`` instead of ``trainer.train()``).
* :mod:`ckptless.integrations.lightning`: PyTorch Lightning
  (``ckptless.integrations.lightning.fit(trainer, model, ...)``).
* :mod:`ckptless.integrations.accelerate`: a Hugging Face Accelerate custom loop
  (``job.train(ckptless.integrations.accelerate.loop(accelerator, train), ...)``).

Each declares the framework versions it is tested on as an extra's range (``pip install
ckptless[hf]``, ``ckptless[lightning]``; docs/compatibility.md) and is imported only by the script
that uses it: ``import ckptless`` never imports a framework.
"""
