"""Callbacks for training frameworks, each in its own module so that importing one never imports
the other framework:

* :mod:`spotguard.integrations.lightning`: :class:`SpotguardCallback` for PyTorch Lightning
  (``pip install spotguard[lightning]``): spotguard checkpoints hold Lightning's full state.
* :mod:`spotguard.integrations.huggingface`: :class:`SpotguardTrainerCallback` for the Hugging Face
  ``Trainer`` (``pip install spotguard[hf]``): the Trainer's own ``checkpoint-N`` directories.
* :mod:`spotguard.integrations.ray`: :class:`RayRun`, a ``Run`` inside Ray Train's
  ``train_loop_per_worker`` (``pip install spotguard[ray]``; docs/deploy/ray.md).
"""

__all__: list[str] = []
